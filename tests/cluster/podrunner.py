"""A local pod runner: plays kubelet and container runtime for the pseudo Spyre nodes. Test and demo
infrastructure, never shipped.

For every pod bound to one of its nodes it runs the first container's command as a local process and reports
status back to the API server. The mappings, in one place:

- image: an image is this project's environment; any image whose name contains `runtime` runs the venv's
  `spyre-runtime`, any containing `operator` runs `spyre-operator` (the command's first word is looked up in
  the venv's bin/). The runtime image's own environment (`image_env`) comes first, the pod's env over it.
- network: each pod gets its own loopback address 127.A.B.C as pod IP (A from the runner's PID); `$(VAR)` in
  args is expanded. The Endpoints API refuses loopback addresses; EndpointSlices carry them, so clients read
  the ready addresses of a Service from its EndpointSlices (as kube-proxy does).
- env: `value`, `valueFrom.fieldRef` for metadata.name, metadata.namespace, status.podIP, spec.nodeName, and
  `valueFrom.secretKeyRef` / `configMapKeyRef`.
- volumes: a PersistentVolumeClaim is one directory per claim (`<root>/pvc/<namespace>/<claim>`), shared by
  all pods that mount it; emptyDir is a fresh directory per pod; configMap and secret are written as files;
  an image volume (`image: {reference}`) is the local folder `image_folders` gives for that reference, as the
  image's `/models` folder (a model image's files); a mount's `subPath` is that folder of the volume (made
  when missing, as the kubelet does). A `readOnly` mount (or any mount of a claim volume with `readOnly`)
  is a read-only bind mount of that folder under the pod's folder, so a write through it fails (EROFS) as in
  a container; binding needs root, as `make test` runs here (without root the folder is used as it is, and
  the pod's log says so). The process is not in a mount namespace, so every env value and arg that starts
  with a container mountPath is rewritten to the local directory (longest mount path first).
- init containers (the modelcar pattern) run in order before the first container, each to completion: the
  command's first word from the venv's bin/ or the system's PATH, its mounts rewritten likewise, and paths
  under `/models` (a model image's files) rewritten to its image's folder in `image_folders`; one that fails
  fails the pod (phase Failed, reason Init:Error, its log's tail as the message).
- service account: the API server address and the pod's service-account token go into a kubeconfig the
  process finds through KUBECONFIG (in-cluster config would read fixed paths under /var/run/secrets).
- status: Pending -> Running -> Succeeded/Failed; `Ready` follows the readinessProbe (HTTP GET on the pod
  IP), `started` once it first passed (the startup probe asks the same /health), each condition stamped when
  it flips;
  restarts per restartPolicy with restartCount, lastState and CrashLoopBackOff; a failed container's log tail
  becomes its termination message under `terminationMessagePolicy: FallbackToLogsOnError`.
- before the first start, a kubelet's checks (kubelet_checks.py), init containers first: InvalidImageName,
  ErrImagePull for an image in `unpullable`, CreateContainerConfigError for a missing Secret or ConfigMap key
  or for `runAsNonRoot` with an image that runs as root (`image_users`, else kubelet_checks.image_user).
- deletion: SIGTERM, the grace period, SIGKILL, then the pod object is removed. stop() stops every process.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.cluster.controlplane import kubeconfig_yaml, service_account_token
from tests.cluster.fakekubelet import provision_pending_claims
from tests.cluster.kubelet_checks import start_blocker, waiting_status

VENV_BIN = Path(__file__).resolve().parents[2] / ".venv" / "bin"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class NotYet(Exception):
    """The pod cannot start yet (e.g. its service-account token does not exist yet); retried next pass."""


def image_env(image: str) -> dict[str, str]:
    """What an image's own ENV gives its containers before the pod's env. The runtime image
    (Containerfile.runtime) sets TORCH_EXTENSIONS_DIR to the folder where its build prebuilt the paged
    attention kernel, so a pod loads it and never builds it; here that folder is the host's build of the same
    source (the runner's own TORCH_EXTENSIONS_DIR, else torch's default build root), made once and shared by
    every pod. (Without it each pod's HOME, an emptyDir, made each runtime pod compile the kernel again.)"""
    if "runtime" not in image:
        return {}
    return {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR") or _torch_build_root()}


@functools.cache
def _torch_build_root() -> str:
    from torch.utils.cpp_extension import get_default_build_root

    return get_default_build_root()


@dataclass
class RunningPod:
    uid: str
    namespace: str
    name: str
    ip: str
    workdir: Path
    restart_policy: str
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: str = ""
    last_exit: dict | None = None
    ready: bool = False
    warm: bool = False  # the process passed its startup probe (was Ready once): the kubelet's `started`
    phase: str = "Pending"
    next_start: float = 0.0
    terminating_since: float | None = None
    last_reported: str = ""
    transitions: dict[str, tuple[str, str]] = field(default_factory=dict)  # condition -> (status, since)
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    probe: dict | None = None
    log: Path | None = None
    volumes: dict[str, Path] = field(default_factory=dict)
    read_only: set[str] = field(default_factory=set)  # volumes every mount of which is read-only
    bind_mounts: list[Path] = field(default_factory=list)  # read-only bind mounts, unmounted at the end


class PodRunner:
    def __init__(
        self,
        api_client,
        kubeconfig: Path,
        server: str,
        ca_file: Path,
        nodes: list[str],
        root: Path,
        period: float = 0.5,
        image_folders: dict[str, Path] | None = None,
    ) -> None:
        self.core = client.CoreV1Api(api_client)
        self.image_folders = dict(image_folders or {})  # image reference -> the folder of its /models
        self.kubeconfig = kubeconfig
        self.server = server
        self.ca_file = ca_file
        self.nodes = set(nodes)
        self.root = Path(root)
        self.period = period
        self.pods: dict[str, RunningPod] = {}
        self.unpullable: set[str] = set()  # images that fail with ErrImagePull (kubelet_checks)
        self.image_users: dict[str, str] = {}  # image -> its USER (kubelet_checks.image_user: else root)
        self.blocked: dict[str, tuple[str, str, str]] = {}  # pod uid -> what keeps it from starting
        self.admitted: list[tuple[str, str, str]] = []  # (namespace, name, uid) of every pod ever started
        self.failed_passes = 0
        self.last_error = ""
        self._next_ip = 2
        # runners in other processes (pytest-xdist workers, a demo) take other 127.A.B.C ranges, so two
        # runners never give two pods the same address and port
        self._ip_net = 20 + os.getpid() % 200
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pod-runner", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> PodRunner:
        self._thread.start()
        return self

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for rp in list(self.pods.values()):
            self._kill(rp, grace=5)
            _unmount(rp)

    def __enter__(self) -> PodRunner:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _loop(self) -> None:
        """As a kubelet does, every pass re-lists: an API server that refuses connections, restarts or
        stalls costs passes, never the loop. Each failure is counted and its message kept."""
        while not self._stop.wait(self.period):
            try:
                self.sync()
            except Exception as e:  # ApiException, urllib3's MaxRetryError and ProtocolError, timeouts
                self.failed_passes += 1
                self.last_error = f"{type(e).__name__}: {e}"

    # ---- one pass --------------------------------------------------------------------------------

    def sync(self) -> None:
        namespaces = set()
        seen = set()
        for pod in self.core.list_pod_for_all_namespaces().items:
            namespaces.add(pod.metadata.namespace)
            if pod.spec.node_name not in self.nodes:
                continue
            seen.add(pod.metadata.uid)
            rp = self.pods.get(pod.metadata.uid)
            if pod.metadata.deletion_timestamp:
                self._delete(pod, rp)
                continue
            if rp is None:
                if self._blocked(pod):
                    continue
                rp = self._admit(pod)
            if rp is not None:
                self._tick(pod, rp)
        for uid in [u for u in self.pods if u not in seen]:  # removed behind our back
            rp = self.pods.pop(uid)
            self._kill(rp, grace=5)
            _unmount(rp)
        for ns in namespaces:
            provision_pending_claims(self.core, ns, str(self.root / "pv"))

    def _blocked(self, pod) -> bool:
        """A kubelet's checks before the first start (kubelet_checks); the waiting status is written once
        per distinct reason and the pod is checked again next pass."""
        blocked = start_blocker(self.core, pod, self.unpullable, self.image_users)
        if blocked is None:
            self.blocked.pop(pod.metadata.uid, None)
            return False
        if self.blocked.get(pod.metadata.uid) != blocked:
            self.core.patch_namespaced_pod_status(
                pod.metadata.name, pod.metadata.namespace, waiting_status(pod, *blocked, _now())
            )
            self.blocked[pod.metadata.uid] = blocked
        return True

    def _key_ref(self, pod, env) -> str | None:
        """The value of a secretKeyRef or configMapKeyRef (None: optional and absent; kubelet_checks has
        already kept a pod with a missing required one from starting)."""
        ns, source = pod.metadata.namespace, env.value_from
        try:
            if source.secret_key_ref:
                ref = source.secret_key_ref
                data = self.core.read_namespaced_secret(ref.name, ns).data or {}
                return base64.b64decode(data[ref.key]).decode() if ref.key in data else None
            if source.config_map_key_ref:
                ref = source.config_map_key_ref
                return (self.core.read_namespaced_config_map(ref.name, ns).data or {}).get(ref.key)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        raise ValueError(f"env {env.name}: only fieldRef, secretKeyRef and configMapKeyRef are supported")

    def _admit(self, pod) -> RunningPod | None:
        ip = f"127.{self._ip_net}.{self._next_ip >> 8}.{self._next_ip & 255}"
        self._next_ip += 1
        workdir = self.root / "pods" / f"{pod.metadata.namespace}_{pod.metadata.name}"
        workdir.mkdir(parents=True, exist_ok=True)
        rp = RunningPod(
            pod.metadata.uid,
            pod.metadata.namespace,
            pod.metadata.name,
            ip,
            workdir,
            pod.spec.restart_policy or "Always",
        )
        try:
            rp.argv, rp.env = self._process_spec(pod, rp)
            failure = self._run_init_containers(pod, rp)
        except NotYet:
            _unmount(rp)
            self._next_ip -= 1
            return None
        except ValueError as e:
            _unmount(rp)
            self._report(pod, rp, phase="Failed", reason="RunnerError", message=str(e))
            return None
        except BaseException:  # an API error: tried again next pass, with no mount left behind
            _unmount(rp)
            raise
        if failure:
            rp.phase = "Failed"
            rp.last_exit = {"exitCode": 1, "reason": "Init:Error", "message": failure, "finishedAt": _now()}
            self._report(pod, rp, phase="Failed", reason="Init:Error", message=failure)
            self.pods[rp.uid] = rp
            return None
        c = pod.spec.containers[0]
        if c.readiness_probe and c.readiness_probe.http_get:
            hg = c.readiness_probe.http_get
            rp.probe = {"path": hg.path or "/", "port": self._port(c, hg.port)}
        rp.log = workdir / "container.log"
        self.pods[rp.uid] = rp
        self.admitted.append((rp.namespace, rp.name, rp.uid))
        return rp

    @staticmethod
    def _port(container, port) -> int:
        if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
            return int(port)
        for p in container.ports or []:
            if p.name == port:
                return p.container_port
        raise ValueError(f"unknown named port {port}")

    def _volumes(self, pod, rp: RunningPod) -> dict[str, Path]:
        local: dict[str, Path] = {}
        for v in pod.spec.volumes or []:
            if v.persistent_volume_claim and v.persistent_volume_claim.read_only:
                rp.read_only.add(v.name)
            if v.persistent_volume_claim:
                local[v.name] = self.root / "pvc" / rp.namespace / v.persistent_volume_claim.claim_name
            elif v.empty_dir is not None:
                local[v.name] = rp.workdir / "emptydir" / v.name
            elif v.config_map:
                local[v.name] = rp.workdir / "configmap" / v.name
                cm = self.core.read_namespaced_config_map(v.config_map.name, rp.namespace)
                local[v.name].mkdir(parents=True, exist_ok=True)
                for k, val in (cm.data or {}).items():
                    (local[v.name] / k).write_text(val)
            elif v.image is not None:
                folder = self.image_folders.get(v.image.reference)
                if folder is None:
                    raise ValueError(f"image volume {v.name}: no local folder for {v.image.reference}")
                local[v.name] = rp.workdir / "image" / v.name
                local[v.name].mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(FileExistsError):
                    (local[v.name] / "models").symlink_to(Path(folder).resolve())
                continue
            elif v.secret:
                local[v.name] = rp.workdir / "secret" / v.name
                sec = self.core.read_namespaced_secret(v.secret.secret_name, rp.namespace)
                local[v.name].mkdir(parents=True, exist_ok=True)
                for k, val in (sec.data or {}).items():
                    (local[v.name] / k).write_bytes(base64.b64decode(val))
            else:
                continue
            local[v.name].mkdir(parents=True, exist_ok=True)
        return local

    @staticmethod
    def _mounts(container, rp: RunningPod) -> list[tuple[str, Path]]:
        """(mountPath, local folder), longest path first; a subPath is that folder of the volume; a read-only
        mount is a read-only bind mount of it (`_read_only_view`)."""
        mounts = []
        for m in container.volume_mounts or []:
            if m.name not in rp.volumes:
                continue
            local = rp.volumes[m.name] / m.sub_path if m.sub_path else rp.volumes[m.name]
            local.mkdir(parents=True, exist_ok=True)
            if m.read_only or m.name in rp.read_only:
                local = _read_only_view(rp, local, f"{container.name}-{len(mounts)}")
            mounts.append((m.mount_path, local))
        return sorted(mounts, key=lambda x: -len(x[0]))

    def _process_spec(self, pod, rp: RunningPod) -> tuple[list[str], dict[str, str]]:
        c = pod.spec.containers[0]
        rp.volumes = self._volumes(pod, rp)
        mounts = self._mounts(c, rp)

        def rewrite(value: str) -> str:
            return _rewrite(value, mounts)

        fields = {
            "metadata.name": rp.name,
            "metadata.namespace": rp.namespace,
            "status.podIP": rp.ip,
            "spec.nodeName": pod.spec.node_name,
        }
        env: dict[str, str] = {}
        for e in c.env or []:
            if e.value_from is not None:
                if e.value_from.field_ref:
                    env[e.name] = fields[e.value_from.field_ref.field_path]
                elif (value := self._key_ref(pod, e)) is not None:
                    env[e.name] = value
            else:
                env[e.name] = rewrite(_expand(e.value or "", env))
        command = list(c.command or [])
        if not command:
            raise ValueError(f"container {c.name} has no command (images' entrypoints are not known here)")
        binary = VENV_BIN / command[0]
        if not binary.exists():
            raise ValueError(f"image {c.image}: {command[0]} is not in {VENV_BIN}")
        args = [rewrite(_expand(a, env)) for a in command[1:] + list(c.args or [])]
        sa_kubeconfig = self._service_account_kubeconfig(pod, rp)
        full_env = {
            "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}",
            "HOME": str(rp.workdir),
            **image_env(c.image or ""),
            "PYTHONUNBUFFERED": "1",
            # a checkout beside the installed one (a git worktree) runs its own code in pods too
            **({"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}),
            **({"KUBECONFIG": str(sa_kubeconfig)} if sa_kubeconfig else {}),
            **env,
        }
        return [str(binary), *args], full_env

    def _run_init_containers(self, pod, rp: RunningPod) -> str:
        """Runs each init container to completion; what the failing one said ("" when all succeeded)."""
        for c in pod.spec.init_containers or []:
            mounts = self._mounts(c, rp)
            if c.image in self.image_folders:  # the model image's own files
                mounts = sorted(
                    [*mounts, ("/models", Path(self.image_folders[c.image]))], key=lambda x: -len(x[0])
                )
            argv = [_rewrite(a, mounts) for a in list(c.command or []) + list(c.args or [])]
            if not argv:
                return f"init container {c.name} has no command"
            binary = VENV_BIN / argv[0] if (VENV_BIN / argv[0]).exists() else shutil.which(argv[0])
            if binary is None:
                return f"init container {c.name}: {argv[0]} is not in {VENV_BIN} or on PATH"
            log = rp.workdir / f"init-{c.name}.log"
            with log.open("wb") as out:
                code = subprocess.run(
                    [str(binary), *argv[1:]],
                    cwd=rp.workdir,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    timeout=300,
                ).returncode
            if code != 0:
                tail = log.read_text(errors="replace").splitlines()[-5:]
                return f"init container {c.name} exited with {code}: " + " ".join(tail)
        return ""

    def _service_account_kubeconfig(self, pod, rp: RunningPod) -> Path | None:
        if pod.spec.automount_service_account_token is False:
            return None
        name = pod.spec.service_account_name or "default"
        token = service_account_token(self.core, rp.namespace, name)
        if token is None:
            raise NotYet(f"no token yet for service account {name}")
        path = rp.workdir / "serviceaccount.kubeconfig"
        path.write_text(kubeconfig_yaml(self.server, self.ca_file, token, name, namespace=rp.namespace))
        return path

    # ---- process state machine -------------------------------------------------------------------

    def _tick(self, pod, rp: RunningPod) -> None:
        if rp.proc is None and rp.phase in ("Pending", "Running") and time.monotonic() >= rp.next_start:
            log = open(rp.log, "ab")  # noqa: SIM115
            rp.proc = subprocess.Popen(
                rp.argv,
                env=rp.env,
                cwd=rp.workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            log.close()
            rp.started_at, rp.phase, rp.ready, rp.warm = _now(), "Running", False, False
        if rp.proc is not None and rp.proc.poll() is not None:
            code = rp.proc.returncode
            rp.last_exit = {
                "exitCode": code,
                "reason": "Completed" if code == 0 else "Error",
                "startedAt": rp.started_at,
                "finishedAt": _now(),
            }
            if code != 0 and pod.spec.containers[0].termination_message_policy == "FallbackToLogsOnError":
                # as the kubelet does: the log's tail (at most 80 lines, 2 KiB) is the termination message
                tail = rp.log.read_bytes()[-2048:].decode(errors="replace").splitlines()[-80:]
                rp.last_exit["message"] = "\n".join(tail)
            rp.proc, rp.ready = None, False
            policy = rp.restart_policy
            if policy == "Always" or (policy == "OnFailure" and code != 0):
                rp.restarts += 1
                rp.next_start = time.monotonic() + min(10 * 2 ** (rp.restarts - 1), 300)
            else:
                rp.phase = "Succeeded" if code == 0 else "Failed"
        if rp.proc is not None:
            rp.ready = self._probe(rp) if rp.probe else True
            rp.warm = rp.warm or rp.ready
        self._report(pod, rp)

    def _probe(self, rp: RunningPod) -> bool:
        url = f"http://{rp.ip}:{rp.probe['port']}{rp.probe['path']}"
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                return 200 <= resp.status < 400
        except OSError:
            return False

    def _report(
        self, pod, rp: RunningPod, phase: str | None = None, reason: str = "", message: str = ""
    ) -> None:
        phase = phase or rp.phase
        c = pod.spec.containers[0]
        if rp.proc is not None:
            state = {"running": {"startedAt": rp.started_at}}
        elif phase in ("Succeeded", "Failed") and rp.last_exit:
            state = {"terminated": rp.last_exit}
        elif rp.last_exit:
            state = {"waiting": {"reason": "CrashLoopBackOff", "message": f"back-off restarting {c.name}"}}
        else:
            state = {"waiting": {"reason": reason or "ContainerCreating", "message": message}}
        flag = "True" if rp.ready else "False"
        status = {
            "phase": phase,
            "podIP": rp.ip,
            "podIPs": [{"ip": rp.ip}],
            "hostIP": "127.0.0.1",
            "conditions": [
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": flag},
                {"type": "Ready", "status": flag},
            ],
            "containerStatuses": [
                {
                    "name": c.name,
                    "image": c.image,
                    "imageID": "",
                    "ready": rp.ready,
                    "started": rp.proc is not None and rp.warm,
                    "restartCount": rp.restarts,
                    "state": state,
                    "lastState": {"terminated": rp.last_exit} if rp.last_exit else {},
                }
            ],
        }
        if reason and phase == "Failed":
            status["reason"], status["message"] = reason, message
        key = json.dumps(status, sort_keys=True)
        if key == rp.last_reported:
            return
        now = _now()
        for cond in status["conditions"]:  # as the kubelet: stamped when the condition's status changes
            was, since = rp.transitions.get(cond["type"], ("", now))
            since = since if was == cond["status"] else now
            rp.transitions[cond["type"]] = (cond["status"], since)
            cond["lastTransitionTime"] = since
        with contextlib.suppress(ApiException):
            self.core.patch_namespaced_pod_status(rp.name, rp.namespace, {"status": status})
            rp.last_reported = key

    def _delete(self, pod, rp: RunningPod | None) -> None:
        if rp is not None and rp.proc is not None and rp.proc.poll() is None:
            if rp.terminating_since is None:
                rp.terminating_since = time.monotonic()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(rp.proc.pid, signal.SIGTERM)
            grace = pod.metadata.deletion_grace_period_seconds or 30
            if time.monotonic() - rp.terminating_since < grace:
                return
            self._kill(rp, grace=0)
        if rp is not None:
            self.pods.pop(rp.uid, None)
            _unmount(rp)  # before the folder goes: nothing is removed through a mount
            shutil.rmtree(rp.workdir, ignore_errors=True)
        with contextlib.suppress(ApiException):
            self.core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0)

    @staticmethod
    def _kill(rp: RunningPod, grace: float) -> None:
        if rp.proc is None or rp.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(rp.proc.pid, signal.SIGTERM)
        try:
            rp.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(rp.proc.pid, signal.SIGKILL)
            rp.proc.wait(timeout=10)


def _read_only_view(rp: RunningPod, folder: Path, key: str) -> Path:
    """`folder` seen through a read-only bind mount at <pod folder>/ro/<key> (root only: otherwise the folder
    itself, and a line in the pod's log says the mount is not read-only here)."""
    target = rp.workdir / "ro" / key
    if target in rp.bind_mounts:
        return target
    target.mkdir(parents=True, exist_ok=True)
    bound = subprocess.run(["mount", "--bind", str(folder), str(target)], capture_output=True)
    if bound.returncode != 0:
        with (rp.workdir / "container.log").open("a") as log:
            log.write(f"[pod runner] readOnly not enforced for {folder}: {bound.stderr.decode().strip()}\n")
        return folder
    rp.bind_mounts.append(target)
    remounted = subprocess.run(["mount", "-o", "remount,bind,ro", str(target)], capture_output=True)
    if remounted.returncode != 0:
        raise ValueError(f"cannot make the mount of {folder} read-only: {remounted.stderr.decode().strip()}")
    return target


def _unmount(rp: RunningPod) -> None:
    """Undoes the pod's read-only bind mounts (lazily: a process still inside one does not keep it)."""
    while rp.bind_mounts:
        subprocess.run(["umount", "-l", str(rp.bind_mounts.pop())], capture_output=True)


def _rewrite(value: str, mounts: list[tuple[str, Path]]) -> str:
    """A container path as the local folder it is mounted from (longest mount path first)."""
    for mount_path, local in mounts:
        if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
            return str(local) + value[len(mount_path.rstrip("/")) :]
    return value


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion; $$(VAR) escapes."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        value,
    )
