"""The whole system on one machine, as a user meets it: control plane, pseudo Spyre nodes, the CRD, the
operator installed by its Helm chart and run by the local pod runner, which also runs the inference pods.
Used by the end-to-end test and by `make demo`. With `node="kubelet"` (`make demo NODE=kubelet`) a real node
instead (tests/cluster/node.py): containerd and the kubelet run the operator's image and the runtime's.
Test and demo infrastructure, never shipped."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from kubernetes import client

from tests.cluster.controlplane import ControlPlane, pid_alive, spyre_nodes
from tests.cluster.node import RealNode, apiserver_args
from tests.cluster.node import operator_values as node_operator_values
from tests.cluster.podrunner import PodRunner

REPO = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "spyre-serve.io", "v1alpha1", "spyremodels"
NODE_KINDS = ("podrunner", "kubelet")


class StackError(RuntimeError):
    pass


def operator_rollout_report(apps, core, namespace: str = "spyre-system") -> str:
    """What a rollout that never finished left behind: the Deployment's status, each operator pod's
    containers (waiting or terminated, why, restarts), the namespace's newest Events and the operator's last
    log lines, so that a timeout names its cause."""
    lines = []
    try:
        d = apps.read_namespaced_deployment("spyre-spyre-operator", namespace)
        st = d.status
        lines.append(
            f"deployment: generation {d.metadata.generation}, observed {st.observed_generation}, "
            f"updated {st.updated_replicas}, ready {st.ready_replicas} of {d.spec.replicas}"
        )
        lines += [f"  {c.type}={c.status} {c.reason}: {c.message}" for c in st.conditions or []]
        pods = core.list_namespaced_pod(namespace).items
        for pod in pods:
            lines.append(f"pod {pod.metadata.name}: {pod.status.phase} on {pod.spec.node_name}")
            for c in pod.status.container_statuses or []:
                state = c.state.waiting or c.state.terminated or c.state.running
                reason = getattr(state, "reason", None) or "running"
                message = getattr(state, "message", None) or ""
                code = getattr(state, "exit_code", None)
                lines.append(
                    f"  {c.name} ({c.image}): {reason} {message} exit={code} restarts={c.restart_count}"
                )
            for previous in (False, True):
                try:
                    log = core.read_namespaced_pod_log(
                        pod.metadata.name, namespace, tail_lines=20, previous=previous
                    )
                except client.ApiException:
                    continue
                lines.append(f"  log{' (previous)' if previous else ''}:")
                lines += [f"    {line}" for line in log.splitlines()]
        events = sorted(
            core.list_namespaced_event(namespace).items,
            key=lambda e: str(e.last_timestamp or e.event_time or ""),
        )[-20:]
        lines += [f"event {e.involved_object.name}: {e.reason}: {e.message}" for e in events]
    except client.ApiException as e:
        lines.append(f"(the API said {e.status} {e.reason} while the report was made)")
    return "\n".join(lines)


def ready_addresses(api_client, namespace: str, service: str) -> list[str]:
    """A Service's ready addresses, as published by the (real) EndpointSlice controller. (The older Endpoints
    API refuses loopback addresses, which pod IPs are here; EndpointSlices carry them.)"""
    slices = client.CustomObjectsApi(api_client).list_namespaced_custom_object(
        "discovery.k8s.io",
        "v1beta1",
        namespace,
        "endpointslices",
        label_selector=f"kubernetes.io/service-name={service}",
    )["items"]
    return sorted(
        address
        for sl in slices
        for ep in sl.get("endpoints") or []
        if (ep.get("conditions") or {}).get("ready")
        for address in ep.get("addresses") or []
    )


class LocalStack:
    def __init__(
        self,
        workdir: Path,
        say: Callable[[str], None] = lambda _: None,
        die_with_parent: bool = True,
        control_plane: ControlPlane | None = None,
        node: str = "podrunner",
    ):
        """`control_plane`: one already running (a real node's, tests/cluster/node.py), used as it is.
        `node`: who runs the pods, "podrunner" (local processes) or "kubelet" (a real node)."""
        if node not in NODE_KINDS:
            raise StackError(f"unknown node kind {node!r}: expected one of {', '.join(NODE_KINDS)}")
        self.workdir = Path(workdir)
        self.say = say
        self.node_kind = node
        extra = apiserver_args() if node == "kubelet" else ()
        self.cp = control_plane or ControlPlane(
            self.workdir / "cluster", die_with_parent=die_with_parent, extra_apiserver_args=extra
        )
        self.runner: PodRunner | None = None
        self.node: RealNode | None = None
        self.kube = control_plane.api_client() if control_plane else None

    def kubectl(self, *args: str) -> str:
        res = self.cp.kubectl(*args, check=False)
        if res.returncode:
            raise StackError(f"kubectl {' '.join(args)} failed: {res.stderr.strip()}")
        return res.stdout

    def start(self, operator_values: dict | None = None) -> LocalStack:
        self.say(
            "starting the Kubernetes control plane (etcd, kube-apiserver, controller-manager, scheduler)"
        )
        self.cp.start()
        self.kube = self.cp.api_client()
        if self.node_kind == "kubelet":
            return self._start_on_a_real_node(operator_values)
        nodes = self.cp.register_nodes(spyre_nodes(count=2, cards=8))
        self.say(f"registered pseudo Spyre nodes {', '.join(nodes)} with 8 ibm.com/spyre_pf cards each")
        self.say("applying the SpyreModel CRD")
        self.apply_crd()
        self.say(
            "starting the local pod runner (plays kubelet: pods run as local processes on their own "
            "127.x.y.z addresses)"
        )
        self.runner = PodRunner(
            self.kube,
            self.cp.kubeconfig,
            self.cp.server,
            self.cp.workdir / "pki/ca.crt",
            nodes,
            self.workdir / "runner",
        ).start()
        self.say("installing the operator with its Helm chart (real Helm engine)")
        self.install_operator(operator_values or {})
        return self

    def _start_on_a_real_node(self, values: dict | None) -> LocalStack:
        self.say(
            "starting a real node: containerd, the kubelet 1.20, a CNI bridge of its own and a device plugin "
            "with 8 ibm.com/spyre_pf cards (what it changes on the host is put back when it stops)"
        )
        self.node = RealNode(self.cp, self.workdir / "node").start()
        self.say(
            f"node {self.node.name} Ready in {self.node.ready_seconds:.0f} s; applying the SpyreModel CRD"
        )
        self.apply_crd()
        self.say("installing the operator from its image with its Helm chart (real Helm engine)")
        self.install_operator({**node_operator_values(self.node), **(values or {})}, timeout=600)
        return self

    def apply_crd(self) -> None:
        self.kubectl("apply", "--validate=false", "-f", str(REPO / "crds/spyremodels.yaml"))
        self.kubectl("wait", "--for=condition=established", "--timeout=60s", "crd/spyremodels.spyre-serve.io")

    def install_operator(self, values: dict, upgrade: bool = False, timeout: float = 180) -> None:
        """`helm install` (or `helm upgrade`) of the chart; waits until every operator replica runs the
        release's template and is ready."""
        import helm_python as helm

        chart = self.workdir / "chart/spyre-operator"
        shutil.rmtree(chart, ignore_errors=True)
        # the CRD is already applied: 1.20 cannot server-side-apply its CEL rules (see the chart's NOTES)
        shutil.copytree(REPO / "charts/spyre-operator", chart, ignore=shutil.ignore_patterns("crds"))
        with helm.Config(kubeconfig_path=str(self.cp.kubeconfig), namespace="spyre-system") as cfg:
            values = {"resyncSeconds": 5, **values}
            if upgrade:
                cfg.upgrade(str(chart), "spyre", values, namespace="spyre-system", timeout=120)
            else:
                cfg.install(
                    str(chart), "spyre", values, namespace="spyre-system", create_namespace=True, timeout=120
                )
        apps = client.AppsV1Api(self.kube)
        core = client.CoreV1Api(self.kube)

        def rolled_out() -> bool:
            d = apps.read_namespaced_deployment("spyre-spyre-operator", "spyre-system")
            st, want = d.status, d.spec.replicas or 0
            pods = core.list_namespaced_pod(
                "spyre-system", label_selector="app.kubernetes.io/name=spyre-operator"
            ).items
            return (
                st.observed_generation == d.metadata.generation
                and (st.updated_replicas or 0) == want
                and (st.ready_replicas or 0) >= 1
                and (not upgrade or ((st.ready_replicas or 0) == want and len(pods) == want))
            )

        self.wait(
            rolled_out,
            timeout,
            "the operator Deployment to be rolled out and ready",
            lambda: operator_rollout_report(apps, core),
        )

    def stop(self) -> None:
        if self.runner is not None:
            self.runner.stop()
        if self.node is not None:
            self.node.stop()
            for problem in self.node.restore_problems:
                self.say(f"the host was not put back entirely: {problem}")
        self.cp.stop()

    @contextlib.contextmanager
    def running(self, namespace: str):
        """Starts the stack with one namespace for a test module; stops every process afterwards."""
        try:
            self.start()
            self.create_namespace(namespace)
            yield self
        finally:
            self.stop()

    # ---- helpers ---------------------------------------------------------------------------------

    @staticmethod
    def wait(predicate: Callable[[], object], timeout: float, what: str, on_timeout: Callable[[], str] = str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                value = predicate()
            except client.ApiException:
                value = None
            if value:
                return value
            time.sleep(0.5)
        try:
            detail = on_timeout()
        except Exception as e:  # the report must never hide the timeout it explains
            detail = f"(no report: {e!r})"
        raise StackError(f"timed out after {timeout:.0f} s waiting for {what}\n{detail}")

    def create_namespace(self, name: str) -> None:
        core = client.CoreV1Api(self.kube)
        core.create_namespace({"metadata": {"name": name}})
        self.wait(
            lambda: core.read_namespaced_service_account("default", name), 30, "the default service account"
        )

    def model_claim_dir(self, namespace: str, claim: str) -> Path:
        """Where the pod runner keeps the claim's files (pvc://CLAIM/PATH is CLAIM's directory + PATH)."""
        return self.workdir / "runner/pvc" / namespace / claim

    def create_models_claim(self, namespace: str, claim: str = "models") -> Path:
        client.CoreV1Api(self.kube).create_namespaced_persistent_volume_claim(
            namespace,
            {
                "metadata": {"name": claim},
                "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "10Gi"}}},
            },
        )
        path = self.model_claim_dir(namespace, claim)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def apply_model(self, namespace: str, manifest: Path | dict) -> None:
        if isinstance(manifest, Path):
            self.kubectl("apply", "--validate=false", "-n", namespace, "-f", str(manifest))
            return
        custom = client.CustomObjectsApi(self.kube)
        name = manifest["metadata"]["name"]
        try:
            custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)
        except client.ApiException as e:
            if e.status != 409:
                raise
            custom.patch_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, {"spec": manifest["spec"]}
            )

    def model(self, namespace: str, name: str) -> dict:
        return client.CustomObjectsApi(self.kube).get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name
        )

    def is_ready(self, namespace: str, name: str, replicas: int) -> bool:
        m = self.model(namespace, name)
        st = m.get("status") or {}
        ready = {c["type"]: c for c in st.get("conditions") or []}.get("Ready", {}).get("status") == "True"
        return (
            ready
            and st.get("readyReplicas") == replicas
            and st.get("replicas") == replicas
            and st.get("observedGeneration") == m["metadata"]["generation"]
        )

    def endpoints(self, namespace: str, service: str) -> list[str]:
        return ready_addresses(self.kube, namespace, service)

    def diagnose(self, namespace: str, name: str) -> str:
        """What a failure shows: the model's conditions, its pods, and their last log lines."""
        lines = []
        try:
            for c in (self.model(namespace, name).get("status") or {}).get("conditions") or []:
                lines.append(
                    f"  condition {c['type']}={c['status']} {c.get('reason', '')}: {c.get('message', '')}"
                )
        except client.ApiException as e:
            lines.append(f"  model unreadable: {e.reason}")
        for rp in self.runner.pods.values() if self.runner else []:
            if rp.namespace == namespace and rp.log and rp.log.exists():
                tail = rp.log.read_text(errors="replace").splitlines()[-15:]
                lines.append(f"  pod {rp.name} ({rp.ip}) restarts={rp.restarts}, last log lines:")
                lines += [f"    {t}" for t in tail]
        return "\n".join(lines)


# ---- a stack that outlives the command that started it (`make demo`, `make demo-down`) ------------------


def _state_file(workdir: Path) -> Path:
    return Path(workdir) / "stack.json"


def run_forever(workdir: Path, node: str = "podrunner") -> int:
    """Runs the stack in this process until SIGTERM/SIGINT; the pod runner (or the real node) lives here."""
    import json
    import signal
    import threading

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stack = LocalStack(workdir, say=lambda m: print(f"[stack] {m}", flush=True), node=node)
    try:
        stack.start()
        _state_file(workdir).write_text(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "kubeconfig": str(stack.cp.kubeconfig),
                    "kubectl": str(stack.cp.bin_dir / "kubectl"),
                    "node": node,
                    "ready": True,
                }
            )
        )
        print("[stack] ready", flush=True)
        stop.wait()
    except Exception as e:  # reported to `up` through the log
        print(f"[stack] FAILED: {e}", flush=True)
        return 1
    finally:
        print("[stack] stopping pods, operator and control plane", flush=True)
        stack.stop()
        _state_file(workdir).unlink(missing_ok=True)
    return 0


def up(workdir: Path, timeout: float = 300, node: str = "podrunner") -> dict:
    """Starts `run_forever` detached (or finds it running, on the same kind of node); returns its state."""
    import json
    import sys

    state_file = _state_file(workdir)
    if state_file.exists():
        state = json.loads(state_file.read_text())
        if pid_alive(state["pid"]):
            if state.get("node", "podrunner") != node:
                raise StackError(
                    f"a stack on a {state.get('node', 'podrunner')} node runs in {workdir}: stop it first "
                    "(make demo-down)"
                )
            return state
        state_file.unlink()
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "stack.log"
    shown = len(log.read_text(errors="replace").splitlines()) if log.exists() else 0  # earlier runs' lines
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.cluster.stack", "run", "--dir", str(workdir), "--node", node],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = log.read_text(errors="replace").splitlines()
        for line in lines[shown:]:
            if line.startswith("[stack]"):
                print(line.replace("[stack]", "[demo]  ", 1), flush=True)
        shown = len(lines)
        if state_file.exists():
            return json.loads(state_file.read_text())
        if proc.poll() is not None:
            raise StackError(
                f"the stack exited with {proc.returncode}; last log lines:\n" + "\n".join(lines[-25:])
            )
        time.sleep(0.5)
    raise StackError(f"the stack was not up within {timeout:.0f} s; see {log}")


def down(workdir: Path) -> bool:
    import json
    import signal

    state_file = _state_file(workdir)
    if not state_file.exists():
        return False
    pid = json.loads(state_file.read_text())["pid"]
    if pid_alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 90
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    state_file.unlink(missing_ok=True)
    return True


if __name__ == "__main__":
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m tests.cluster.stack")
    parser.add_argument("command", choices=["run", "down"])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--node", choices=NODE_KINDS, default="podrunner")
    args = parser.parse_args()
    if args.command == "run":
        sys.exit(run_forever(Path(args.dir), args.node))
    print("stopped" if down(Path(args.dir)) else f"no stack recorded in {args.dir}")
