"""The local control plane is real: nodes, scheduling by card count, clear start-up errors, clean teardown."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
from kubernetes import client

from tests.cluster.controlplane import (
    ControlPlane,
    ControlPlaneError,
    is_port_in_use,
    pid_alive,
    register_nodes,
    spyre_nodes,
)
from tests.conftest import REPO, kubectl, wait_for

pytestmark = pytest.mark.cluster


def test_nodes_show_card_capacity(cluster):
    out = kubectl(cluster, "get", "nodes").stdout
    assert "spyre-node-0" in out and "spyre-node-1" in out
    assert "Ready" in out and "NotReady" not in out
    nodes = json.loads(kubectl(cluster, "get", "nodes", "-o", "json").stdout)["items"]
    spyre = {n["metadata"]["name"]: n for n in nodes if n["metadata"]["name"].startswith("spyre-node-")}
    assert sorted(spyre) == ["spyre-node-0", "spyre-node-1"]
    for node in spyre.values():
        assert node["status"]["allocatable"]["ibm.com/spyre_pf"] == "8"
        assert node["metadata"]["labels"]["ibm.com/spyre.present"] == "true"
        assert node["metadata"]["labels"]["ibm.com/spyre.count"] == "8"
        assert not [t for t in node["spec"].get("taints") or [] if t["key"].startswith("node.kubernetes.io/")]


def test_card_resource_name_is_a_parameter(cluster, kube):
    names = register_nodes(kube, spyre_nodes(count=1, cards=4, card_resource="ibm.com/aiu_pf", prefix="aiu"))
    core = client.CoreV1Api(kube)
    try:
        node = core.read_node(names[0])
        assert node.status.allocatable["ibm.com/aiu_pf"] == "4"
        assert "ibm.com/spyre_pf" not in node.status.allocatable
    finally:
        core.delete_node(names[0])


def card_pod(name: str, node: str, cards: int) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "main",
                    "image": "spyre-serve/runtime:dev",
                    "resources": {
                        "requests": {"ibm.com/spyre_pf": str(cards)},
                        "limits": {"ibm.com/spyre_pf": str(cards)},
                    },
                }
            ],
        },
    }


def test_scheduling_by_card_count(cluster, kube):
    core = client.CoreV1Api(kube)
    ns = "sched-test"
    core.create_namespace({"metadata": {"name": ns}})
    try:
        wait_for(lambda: core.read_namespaced_service_account("default", ns), what="default service account")
        for i in range(3):
            core.create_namespaced_pod(ns, card_pod(f"four-cards-{i}", "spyre-node-0", 4))

        def settled():
            pods = core.list_namespaced_pod(ns).items
            bound = [p for p in pods if p.spec.node_name]
            unschedulable = [
                p
                for p in pods
                if any(
                    c.type == "PodScheduled" and c.reason == "Unschedulable"
                    for c in p.status.conditions or []
                )
            ]
            return (bound, unschedulable) if len(bound) == 2 and len(unschedulable) == 1 else None

        bound, pending = wait_for(settled, timeout=60, what="2 pods bound and 1 unschedulable")
        assert {p.spec.node_name for p in bound} == {"spyre-node-0"}
        assert pending[0].status.phase == "Pending"

        def failed_scheduling_event():
            events = core.list_namespaced_event(
                ns, field_selector=f"involvedObject.name={pending[0].metadata.name}"
            ).items
            return [e for e in events if e.reason == "FailedScheduling"]

        events = wait_for(failed_scheduling_event, what="a FailedScheduling event")
        assert "Insufficient ibm.com/spyre_pf" in events[0].message
    finally:
        # No kubelet finalizes bound pods: delete them at once, then the namespace.
        for pod in core.list_namespaced_pod(ns).items:
            core.delete_namespaced_pod(pod.metadata.name, ns, grace_period_seconds=0)
        core.delete_namespace(ns)


def test_port_already_taken_is_named(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cp = ControlPlane(workdir=tmp_path, apiserver_port=port)
        with pytest.raises(
            ControlPlaneError, match=rf"kube-apiserver .*127\.0\.0\.1:{port} is already in use"
        ):
            cp.start()
    assert cp.procs == []


def test_a_port_taken_after_it_was_chosen_is_chosen_again(cluster, tmp_path):
    """Parallel test modules each choose free ports; one can bind a port another chose before that one
    binds it. The component that lost its port starts on a new one instead of failing the module."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        cp = ControlPlane(workdir=tmp_path)
        choose = cp._choose_ports

        def choose_then_lose_the_schedulers():
            choose()
            cp.ports["kube-scheduler"] = taken

        cp._choose_ports = choose_then_lose_the_schedulers
        try:
            cp.start()
            assert cp.ports["kube-scheduler"] != taken
            assert is_port_in_use(cp.ports["kube-scheduler"])
            assert len(cp.pids()) == 4 and all(pid_alive(p) for p in cp.pids())
            assert "address already in use" in (tmp_path / "kube-scheduler.log").read_text()
        finally:
            cp.stop()


def test_missing_binary_is_named(tmp_path):
    cp = ControlPlane(workdir=tmp_path / "work", bin_dir=tmp_path / "empty-bin")
    with pytest.raises(ControlPlaneError, match=r"kube-apiserver binary not found at .*empty-bin"):
        cp.start()


def test_component_crash_shows_its_log(cluster, tmp_path):
    """A component that dies at start-up is named, with its last log lines; what started is stopped."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("kube-controller-manager", "kube-scheduler"):
        (bin_dir / name).symlink_to(cluster.bin_dir / name)
    fake = bin_dir / "kube-apiserver"
    fake.write_text("#!/bin/sh\necho 'E1121 cannot load TLS certificate: boom' >&2\nexit 3\n")
    fake.chmod(0o755)
    cp = ControlPlane(workdir=tmp_path / "work", bin_dir=bin_dir)
    with pytest.raises(ControlPlaneError) as err:
        cp.start()
    assert "kube-apiserver exited during start-up (code 3)" in str(err.value)
    assert "cannot load TLS certificate: boom" in str(err.value)
    etcd_port = cp.ports["etcd-client"]
    assert cp.procs == []
    assert not is_port_in_use(etcd_port)


def test_teardown_leaves_no_process_or_port(cluster, tmp_path):
    cp = ControlPlane(workdir=tmp_path)
    cp.start()
    pids, ports = cp.pids(), dict(cp.ports)
    assert len(pids) == 4 and all(pid_alive(p) for p in pids)
    assert all(is_port_in_use(p) for name, p in ports.items() if name != "etcd-peer")
    cp.stop()
    assert not [p for p in pids if pid_alive(p)]
    assert not [p for p in ports.values() if is_port_in_use(p)]


def test_killed_parent_takes_the_control_plane_with_it(cluster, tmp_path):
    """Interrupted runs leave nothing: children die with the process that started them, even on SIGKILL."""
    script = textwrap.dedent(
        f"""
        import json, sys, time
        sys.path.insert(0, {str(REPO)!r})
        from tests.cluster.controlplane import ControlPlane
        cp = ControlPlane(workdir={str(tmp_path)!r})
        cp.start()
        print(json.dumps({{"pids": cp.pids(), "ports": cp.ports}}), flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(parent.stdout.readline())
        assert all(pid_alive(p) for p in info["pids"])
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    wait_for(lambda: not [p for p in info["pids"] if pid_alive(p)], timeout=30, what="children to exit")
    wait_for(lambda: not [p for p in info["ports"].values() if is_port_in_use(p)], what="ports to close")


def test_cli_up_and_down(cluster, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    up = subprocess.run(
        [sys.executable, "-m", "tests.cluster", "up", "--dir", str(tmp_path), "--nodes", "1", "--cards", "4"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=180,
    )
    state = json.loads((tmp_path / "state.json").read_text()) if (tmp_path / "state.json").exists() else None
    try:
        assert up.returncode == 0, up.stderr
        assert f"export KUBECONFIG={tmp_path / 'kubeconfig'}" in up.stdout
        # the cluster outlives the command that started it
        assert all(pid_alive(p) for p in state["pids"].values())
        nodes = subprocess.run(
            [str(cluster.bin_dir / "kubectl"), f"--kubeconfig={tmp_path / 'kubeconfig'}", "get", "nodes"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "spyre-node-0" in nodes
    finally:
        down = subprocess.run(
            [sys.executable, "-m", "tests.cluster", "down", "--dir", str(tmp_path)],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=60,
        )
    assert down.returncode == 0, down.stderr
    assert not [p for p in state["pids"].values() if pid_alive(p)]
    assert not [p for p in state["ports"].values() if is_port_in_use(p)]
