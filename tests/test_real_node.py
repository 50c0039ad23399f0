"""End to end on a real node (issue 34): the runtime image built from Containerfile.runtime, run by containerd
and runc under a real kubelet 1.20, its cards handed out by the kubelet through the device-plugin API, its
model copied in by the modelcar init container of an `oci://` model image, answering the official OpenAI
client with the same greedy text the engine gives on the host. The pod is the one the operator builds
(manifests.pod_template), so its security context, volumes, probes and environment are the product's.

Needs root and the caches `make node` fills (tests/cluster/build-node.sh, build-images.sh)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import openai
import pytest
from kubernetes import client

from tests.cluster import images
from tests.cluster.controlplane import ControlPlane
from tests.cluster.deviceplugin import env_name
from tests.cluster.hoststate import SYSCTLS, mount_points
from tests.cluster.node import CARD_RESOURCE, RealNode, apiserver_args, missing_prerequisites

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]

NS = "real-node"
PROMPT = "The capital of France"
UID = 1000650000  # an arbitrary uid, as OpenShift's restricted SCC assigns one
SHAPE = (64, 16, 2)


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory):
    missing = missing_prerequisites()
    if missing:
        pytest.fail("the real node is not built (run `make node`): missing " + ", ".join(missing))
    cp = ControlPlane(workdir=tmp_path_factory.mktemp("real-cp"), extra_apiserver_args=apiserver_args())
    cp.start()
    try:
        yield cp
    finally:
        cp.stop()


def host_snapshot() -> dict:
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return {
        "sysctls": {
            n: Path("/proc/sys", n).read_text().strip() for n in SYSCTLS if Path("/proc/sys", n).exists()
        },
        "mounts": sorted(mount_points()),
        "links": sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines()),
        "cgroups": sorted(p.name for p in Path("/sys/fs/cgroup/memory").iterdir() if p.is_dir()),
        "paths": {p: os.path.exists(p) for p in ("/var/lib/kubelet", "/var/log/pods", "/run/netns")},
    }


def test_node_registers_runs_a_pod_and_puts_the_host_back(control_plane, tmp_path):
    """Runs first, on a node of its own: what the kubelet, containerd and CNI changed is gone afterwards."""
    before = host_snapshot()
    node = RealNode(control_plane, tmp_path / "node", name="spyre-kubelet-probe")
    try:
        node.start()
        core = client.CoreV1Api(control_plane.api_client())
        status = core.read_node(node.name).status
        assert status.node_info.container_runtime_version.startswith("containerd://")
        assert status.allocatable[CARD_RESOURCE] == "8"
        assert {a.type: a.address for a in status.addresses}["InternalIP"] == node.node_ip
        core.create_namespace({"metadata": {"name": "probe"}})
        pod = {
            "metadata": {"name": "sleeper", "namespace": "probe"},
            "spec": {
                "nodeName": node.name,
                "containers": [{"name": "pause", "image": images.pod_image("pause")}],
                "automountServiceAccountToken": False,
            },
        }
        core.create_namespaced_pod("probe", pod)
        wait_pod(core, "probe", "sleeper", 120, lambda p: p.status.phase == "Running")
        during = host_snapshot()
        assert during != before  # the node did change the host (bridge, mounts, cgroups) ...
    finally:
        node.stop()
    assert node.restore_problems == []
    assert host_snapshot() == before  # ... and put every bit of it back
    print(f"\n[real-node] node Ready with its cards in {node.ready_seconds:.1f} s")


@pytest.fixture(scope="module")
def node(control_plane, tmp_path_factory):
    with RealNode(control_plane, tmp_path_factory.mktemp("real-node")) as n:
        client.CoreV1Api(control_plane.api_client()).create_namespace({"metadata": {"name": NS}})
        yield n
    assert n.restore_problems == []


def wait_pod(core, namespace: str, name: str, timeout: float, predicate, what: str = "the pod"):
    deadline, pod = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        pod = core.read_namespaced_pod(name, namespace)
        if predicate(pod):
            return pod
        time.sleep(0.5)
    events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
    raise AssertionError(
        f"{what} {namespace}/{name} did not get there in {timeout:.0f} s; "
        f"status: {pod.status if pod else None}\n" + "\n".join(f"  {e.reason}: {e.message}" for e in events)
    )


def operator_pod(name: str) -> dict:
    """The serving pod the operator builds for an `oci://` tiny model (eager, one static shape, no cache)."""
    from spyre_operator.manifests import pod_template
    from spyre_operator.model_spec import GraphCache, ModelSpec, StaticShape
    from spyre_operator.settings import OperatorSettings

    spec = ModelSpec(
        source=f"oci://{images.pod_image('tiny-model')}",
        served_model_name="tiny",
        backend="eager",
        shapes=(StaticShape(*SHAPE),),
        cache=GraphCache(enabled=False),
    )
    settings = OperatorSettings(runtime_image=images.pod_image("runtime"), run_as_user=UID)
    return {"metadata": {"name": name, "namespace": NS}, "spec": pod_template(name, spec, settings)}


def host_greedy_answer(tmp_path: Path) -> str:
    """What the engine answers on the host for the same tiny model (same seed, same bytes)."""
    from spyre_runtime.engine.llm_engine import LLM
    from spyre_runtime.models import write_tiny_model
    from spyre_runtime.sampling.params import SamplingParams

    env = {
        "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager",
        "SENDNN_INFERENCE_USE_CB": "0",
        "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": str(SHAPE[0]),
        "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": str(SHAPE[1]),
        "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": str(SHAPE[2]),
    }
    llm = LLM(write_tiny_model(tmp_path / "tiny"), environ=env)
    try:
        return llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0))[0].text
    finally:
        llm.close()


def test_runtime_image_serves_the_modelcar_model_on_the_real_node(node, tmp_path):
    cp, core = node.cp, client.CoreV1Api(node.cp.api_client())
    t0 = time.monotonic()
    core.create_namespaced_pod(NS, operator_pod("tiny-0"))
    pod = wait_pod(
        core,
        NS,
        "tiny-0",
        900,
        lambda p: any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or []),
        "the runtime pod to be Ready",
    )
    print(f"\n[real-node] runtime pod Ready in {time.monotonic() - t0:.1f} s (image pull included)")
    assert pod.spec.node_name == node.name and pod.status.pod_ip.startswith("10.213.")

    c = openai.OpenAI(
        base_url=f"http://{pod.status.pod_ip}:8000/v1", api_key="unused", max_retries=0, timeout=60
    )
    answer = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    assert answer == host_greedy_answer(tmp_path)

    def exec_(*cmd: str) -> subprocess.CompletedProcess:
        return cp.kubectl("exec", "-n", NS, "tiny-0", "-c", "runtime", "--", *cmd, check=False)

    ids = exec_("id", "-u").stdout.split() + exec_("id", "-G").stdout.split()
    assert ids[0] == str(UID) and "0" in ids[1:], ids  # the arbitrary uid, in group 0
    write = exec_("touch", "/models/written-by-the-pod")
    assert write.returncode != 0 and "Read-only file system" in write.stderr  # the model mount is read-only
    root = exec_("touch", "/opt/spyre-serve/x")
    assert root.returncode != 0 and "Read-only file system" in root.stderr  # so is the root filesystem
    cards = exec_("printenv", env_name(CARD_RESOURCE)).stdout.strip()
    assert cards.split(",") == node.plugin.allocations[-1] and len(cards.split(",")) == 1
    logs = cp.kubectl("logs", "-n", NS, "tiny-0", "-c", "runtime").stdout
    assert "/v1/completions" in logs or "Uvicorn running" in logs or logs.strip(), logs
