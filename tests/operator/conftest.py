"""Operator fixtures: the CRD installed in the session's control plane, the operator as a subprocess
(stopped by PID), a namespace per test with a status-only kubelet stand-in."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kubernetes import client

from tests.cluster.controlplane import Proc, free_port, kubeconfig_yaml, service_account_token, terminate
from tests.cluster.fakekubelet import FakeKubelet
from tests.conftest import REPO, kubectl, wait_for

GROUP, VERSION, PLURAL = "spyre-serve.io", "v1alpha1", "spyremodels"
_ns_counter = itertools.count()


class OperatorProcess:
    def __init__(self, kubeconfig: Path, log_path: Path, extra_env: dict | None = None) -> None:
        self.health_port = free_port()
        self.env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "SPYRE_OPERATOR_RESYNC_SECONDS": "3",
            "SPYRE_OPERATOR_STUCK_GRACE_SECONDS": "6",
            "SPYRE_OPERATOR_START_GRACE_SECONDS": "5",
            "SPYRE_OPERATOR_COMPILE_RETRY_SECONDS": "1",
            "SPYRE_OPERATOR_LEASE_SECONDS": "15",
            "SPYRE_OPERATOR_HEALTH_HOST": "127.0.0.1",
            "SPYRE_OPERATOR_HEALTH_PORT": str(self.health_port),
            **(extra_env or {}),
        }
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> OperatorProcess:
        """Starts the operator and waits until it serves its metrics (or exits). `free_port` finds a port that
        was free a moment ago; when another process binds it first, the operator exits at start-up with
        "Address already in use" (a suite's whole session operator once did, and every test on it waited out
        its model), so it is started again on another port. Any other exit is left to the test."""
        for _ in range(5):
            offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            log = open(self.log_path, "ab")  # noqa: SIM115
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "spyre_operator"],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
            log.close()
            if not self._lost_its_port(offset):
                return self
            self.health_port = free_port()
            self.env["SPYRE_OPERATOR_HEALTH_PORT"] = str(self.health_port)
        raise AssertionError(f"the operator found no free health port in 5 tries:\n{self.log()}")

    def _lost_its_port(self, offset: int, timeout: float = 120) -> bool:
        """Until the operator serves its own metrics: False; it exited: whether its port was taken."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                with self.log_path.open("rb") as f:
                    f.seek(offset)
                    return b"Address already in use" in f.read()
            with contextlib.suppress(OSError):
                if "spyre_operator_" in self.scrape() and self.proc.poll() is None:
                    return False
            time.sleep(0.2)
        return False

    def kill(self) -> None:
        """SIGKILL: no chance to clean up, as when a node dies."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None:
            terminate(Proc("operator", self.proc.pid, self.log_path, self.proc), grace=20)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def scrape(self, path: str = "/metrics") -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}{path}", timeout=5) as resp:
            return resp.read().decode()

    def metric(self, name: str, labels: str = "") -> float:
        """The sum of a metric's samples whose labels contain `labels` (0 when none), e.g.
        metric("spyre_operator_reconciles_total", 'result="success"')."""
        total = 0.0
        for line in self.scrape().splitlines():
            if line.startswith("#") or not line.strip():
                continue
            sample, value = line.rsplit(" ", 1)
            if sample.split("{")[0] == name and labels in sample:
                total += float(value)
        return total


def service_account_kubeconfig(cluster, kube, namespace: str, name: str, path: Path) -> Path:
    """A kubeconfig holding the service account's own token, so the operator runs with its RBAC only."""
    core = client.CoreV1Api(kube)
    token = wait_for(
        lambda: service_account_token(core, namespace, name), what=f"a token for {namespace}/{name}"
    )
    path.write_text(kubeconfig_yaml(cluster.server, cluster.workdir / "pki" / "ca.crt", token, name))
    return path


@pytest.fixture(scope="session")
def operator_rbac(cluster, kube, crd):
    """The chart's least-privilege ClusterRole, bound to the operator's service account."""
    kubectl(cluster, "create", "namespace", "spyre-system")
    kubectl(cluster, "apply", "-f", str(REPO / "deploy/rbac/clusterrole.yaml"))
    return "system:serviceaccount:spyre-system:spyre-operator"


@pytest.fixture(scope="session")
def operator(cluster, kube, operator_rbac, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("operator")
    kubeconfig = service_account_kubeconfig(
        cluster, kube, "spyre-system", "spyre-operator", workdir / "kubeconfig"
    )
    proc = OperatorProcess(kubeconfig, workdir / "operator.log").start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture()
def custom(kube):
    return client.CustomObjectsApi(kube)


@pytest.fixture()
def core(kube):
    return client.CoreV1Api(kube)


@pytest.fixture()
def ns(kube, crd):
    """A fresh namespace with a kubelet stand-in; everything in it is removed afterwards."""
    core = client.CoreV1Api(kube)
    name = f"op-{os.getpid()}-{next(_ns_counter)}"
    core.create_namespace({"metadata": {"name": name}})
    wait_for(lambda: core.read_namespaced_service_account("default", name), what="default service account")
    core.create_namespaced_persistent_volume_claim(
        name,
        {
            "metadata": {"name": "models"},
            "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}},
        },
    )
    kubelet = FakeKubelet(kube, name)
    with kubelet:
        try:
            yield Namespace(name, kube, kubelet)
        finally:
            custom = client.CustomObjectsApi(kube)
            for m in custom.list_namespaced_custom_object(GROUP, VERSION, name, PLURAL)["items"]:
                custom.delete_namespaced_custom_object(GROUP, VERSION, name, PLURAL, m["metadata"]["name"])
            wait_for(
                lambda: not core.list_namespaced_pod(name).items, timeout=60, what=f"pods of {name} gone"
            )
    core.delete_namespace(name)
    for pv in core.list_persistent_volume(label_selector="spyre-serve.io/test-provisioner=true").items:
        if pv.spec.claim_ref and pv.spec.claim_ref.namespace == name:
            with contextlib.suppress(client.ApiException):  # the reclaim policy may have removed it already
                core.delete_persistent_volume(pv.metadata.name)


class Namespace:
    def __init__(self, name: str, kube, kubelet: FakeKubelet) -> None:
        self.name, self.kube, self.kubelet = name, kube, kubelet
        self.custom = client.CustomObjectsApi(kube)
        self.core = client.CoreV1Api(kube)

    def apply_model(self, name: str, spec: dict) -> dict:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "SpyreModel",
            "metadata": {"name": name},
            "spec": spec,
        }
        try:
            return self.custom.create_namespaced_custom_object(GROUP, VERSION, self.name, PLURAL, body)
        except client.ApiException as e:
            if e.status != 409:
                raise
            return self.custom.patch_namespaced_custom_object(
                GROUP, VERSION, self.name, PLURAL, name, {"spec": spec}
            )

    def patch_spec(self, name: str, spec: dict) -> dict:
        return self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, self.name, PLURAL, name, {"spec": spec}
        )

    def model(self, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.name, PLURAL, name)

    def condition(self, name: str, type_: str) -> dict:
        for c in (self.model(name).get("status") or {}).get("conditions") or []:
            if c["type"] == type_:
                return c
        return {}

    def pods(self, name: str) -> list:
        return [
            p
            for p in self.core.list_namespaced_pod(
                self.name, label_selector=f"spyre-serve.io/model={name}"
            ).items
            if not p.metadata.deletion_timestamp
        ]

    def events(self, name: str) -> list:
        return self.core.list_namespaced_event(self.name, field_selector=f"involvedObject.name={name}").items

    def wait_ready(self, name: str, replicas: int, timeout: float = 180) -> dict:
        def ready():
            m = self.model(name)
            st = m.get("status") or {}
            conds = {c["type"]: c for c in st.get("conditions") or []}
            ok = (
                conds.get("Ready", {}).get("status") == "True"
                and st.get("readyReplicas") == replicas
                and st.get("observedGeneration") == m["metadata"]["generation"]
                and len(self.pods(name)) == replicas
            )
            return m if ok else None

        return wait_for(ready, timeout=timeout, what=f"{name} Ready with {replicas} replicas")
