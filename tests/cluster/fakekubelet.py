"""A status-only stand-in for the kubelet (and a storage provisioner), for operator tests: it runs nothing.
Pods bound to a node are reported Running and become Ready `ready_delay` seconds later (unless held back
with `ready = False`); and, as a real cluster does to them: crash-loop with a termination message
(`crashing`, `messages`), get evicted (`evict`: phase Failed), never pull their image (`bad_images`), or
fail a kubelet's checks before starting, init containers first (tests/cluster/kubelet_checks.py: an invalid
image, an image in `unpullable`, a missing Secret or ConfigMap key, `runAsNonRoot` with an image that runs as
root: `image_users`), stay Pending with nothing reported when their node's
kubelet is gone (`stopped_nodes`: bound, never started), or
lose readiness when their node goes NotReady (`set_node_ready`). Run-to-completion pods
(restartPolicy Never, e.g. a Job's) are reported Succeeded once `complete_jobs` is set, or Failed when their
Job is in `failing_jobs`; pods being deleted are finalized,
as a kubelet does once their containers stopped; pending claims get a volume. The end-to-end tests use the
real local pod runner instead."""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.cluster.kubelet_checks import start_blocker, waiting_reason, waiting_status


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def provision_pending_claims(
    core: client.CoreV1Api, namespace: str, root: str = "/tmp/spyre-serve-pv"
) -> None:
    """Plays a storage provisioner: every Pending claim gets a hostPath PersistentVolume bound to it
    (the controller-manager's PV controller does the binding)."""
    for claim in core.list_namespaced_persistent_volume_claim(namespace).items:
        if claim.status.phase != "Pending" or claim.spec.volume_name:
            continue
        name = f"pv-{namespace}-{claim.metadata.name}"
        body = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": name, "labels": {"spyre-serve.io/test-provisioner": "true"}},
            "spec": {
                "capacity": {"storage": claim.spec.resources.requests["storage"]},
                "accessModes": claim.spec.access_modes,
                "persistentVolumeReclaimPolicy": "Delete",
                "storageClassName": claim.spec.storage_class_name or "",
                "hostPath": {"path": f"{root}/{namespace}/{claim.metadata.name}"},
                "claimRef": {"namespace": namespace, "name": claim.metadata.name, "uid": claim.metadata.uid},
            },
        }
        with contextlib.suppress(ApiException):
            core.create_persistent_volume(body)


def container_statuses(pod, state_of, ready: bool = False, restarts: int = 0, last: dict | None = None):
    """One status per container of `pod`; `state_of(container)` gives its state."""
    return [
        {
            "name": c.name,
            "image": c.image,
            "imageID": "",
            "ready": ready,
            "started": "running" in state_of(c),
            "restartCount": restarts,
            "state": state_of(c),
            "lastState": last or {},
        }
        for c in pod.spec.containers
    ]


class FakeKubelet:
    def __init__(
        self, api_client, namespace: str, ready: bool = True, period: float = 0.2, workers: int = 1
    ) -> None:
        self.core = client.CoreV1Api(api_client)
        self.namespace = namespace
        self.ready = ready
        self.ready_delay = 0.0  # seconds from Running to Ready (warm-up)
        self.crashing: set[str] = set()
        self.messages: dict[str, str] = {}  # pod -> the container's termination message
        self.evicted: set[str] = set()
        self.bad_images: set[str] = set()
        self.unpullable: set[str] = set()  # images that fail with ErrImagePull (kubelet_checks)
        self.image_users: dict[str, str] = {}  # image -> its USER (kubelet_checks.image_user: else root)
        self.not_ready_nodes: set[str] = set()
        self.stopped_nodes: set[str] = set()  # no kubelet there: pods bound to them are never started
        self._running_since: dict[str, float] = {}
        # status patches in parallel (a real cluster has a kubelet per node); 1 keeps them in order
        self._pool = ThreadPoolExecutor(workers) if workers > 1 else None
        self.complete_jobs = True
        self.failing_jobs: set[str] = set()
        self.period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"fake-kubelet-{namespace}", daemon=True)

    def __enter__(self) -> FakeKubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            # re-lists on the next pass whatever failed: refused connections and restarts cost passes only
            with contextlib.suppress(Exception):
                self.sync()

    def _patch(self, name: str, body: dict) -> None:
        with contextlib.suppress(ApiException):
            self.core.patch_namespaced_pod_status(name, self.namespace, body)

    def evict(self, name: str) -> None:
        self.evicted.add(name)

    def set_node_ready(self, node: str, ready: bool) -> None:
        """As the node lifecycle controller does for a node that stopped posting heartbeats: the node's
        Ready condition turns Unknown and its pods turn not Ready."""
        (self.not_ready_nodes.discard if ready else self.not_ready_nodes.add)(node)
        now = _now()
        status = "True" if ready else "Unknown"
        self.core.patch_node_status(
            node,
            {
                "status": {
                    "conditions": [
                        {
                            "type": "Ready",
                            "status": status,
                            "reason": "KubeletReady" if ready else "NodeStatusUnknown",
                            "message": "kubelet is posting ready status"
                            if ready
                            else "Kubelet stopped posting",
                            "lastHeartbeatTime": now,
                            "lastTransitionTime": now,
                        }
                    ]
                }
            },
        )

    def sync(self) -> None:
        provision_pending_claims(self.core, self.namespace)
        for pod in self.core.list_namespaced_pod(self.namespace).items:
            name = pod.metadata.name
            if pod.metadata.deletion_timestamp:
                with contextlib.suppress(ApiException):
                    self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0)
                self._running_since.pop(name, None)
                continue
            if not pod.spec.node_name or pod.status.phase in ("Failed", "Succeeded"):
                continue
            if pod.spec.node_name in self.stopped_nodes:
                continue
            if pod.spec.restart_policy == "Never":
                self._finish(pod)
                continue
            if name in self.evicted:
                self.core.patch_namespaced_pod_status(name, self.namespace, self._evicted(pod))
                continue
            if blocked := start_blocker(self.core, pod, self.unpullable, self.image_users):
                if waiting_reason(pod) != blocked[1]:
                    self.core.patch_namespaced_pod_status(
                        name, self.namespace, waiting_status(pod, *blocked, _now())
                    )
                self._running_since.pop(name, None)
                continue
            if any(c.image in self.bad_images for c in pod.spec.containers):
                if pod.status.phase != "Pending" or not pod.status.container_statuses:
                    self.core.patch_namespaced_pod_status(name, self.namespace, self._pull_failing(pod))
                continue
            conditions = {c.type: c.status for c in pod.status.conditions or []}
            started = self._running_since.setdefault(name, time.monotonic())
            warmed = self.ready and time.monotonic() - started >= self.ready_delay
            # `ready` gates pods not Ready yet (warming up); a Ready pod stays Ready unless it crashes
            want_ready = (
                (warmed or conditions.get("Ready") == "True")
                and name not in self.crashing
                and pod.spec.node_name not in self.not_ready_nodes
            )
            crashing = name in self.crashing
            has_crash = any(
                cs.state and cs.state.waiting and cs.state.waiting.reason == "CrashLoopBackOff"
                for cs in pod.status.container_statuses or []
            )
            if (
                pod.status.phase == "Running"
                and conditions.get("Ready") == ("True" if want_ready else "False")
                and crashing == has_crash
            ):
                continue
            body = self._status(pod, want_ready, crashing)
            if self._pool is None:
                self.core.patch_namespaced_pod_status(name, self.namespace, body)
            else:
                self._pool.submit(self._patch, name, body)

    def _finish(self, pod) -> None:
        job = (pod.metadata.labels or {}).get("job-name", "")
        if pod.status.phase in ("Succeeded", "Failed") or not (
            self.complete_jobs or job in self.failing_jobs
        ):
            return
        failed = job in self.failing_jobs
        now = _now()
        code, reason = (1, "Error") if failed else (0, "Completed")
        terminated = {"exitCode": code, "reason": reason, "startedAt": now, "finishedAt": now}
        status = {
            "phase": "Failed" if failed else "Succeeded",
            "startTime": now,
            "containerStatuses": container_statuses(pod, lambda c: {"terminated": terminated}),
        }
        self.core.patch_namespaced_pod_status(pod.metadata.name, self.namespace, {"status": status})

    def _evicted(self, pod) -> dict:
        now = _now()
        killed = {"exitCode": 137, "reason": "Error", "startedAt": now, "finishedAt": now}
        return {
            "status": {
                "phase": "Failed",
                "reason": "Evicted",
                "message": "The node was low on resource: memory.",
                "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now}],
                "containerStatuses": container_statuses(pod, lambda c: {"terminated": killed}),
            }
        }

    def _pull_failing(self, pod) -> dict:
        now = _now()
        return {
            "status": {
                "phase": "Pending",
                "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now}],
                "containerStatuses": container_statuses(
                    pod,
                    lambda c: {
                        "waiting": {
                            "reason": "ImagePullBackOff",
                            "message": f'Back-off pulling image "{c.image}"',
                        }
                    },
                ),
            }
        }

    def _status(self, pod, ready: bool, crashing: bool) -> dict:
        flag = "True" if ready else "False"
        now = _now()
        if crashing:
            state = {
                "waiting": {"reason": "CrashLoopBackOff", "message": "back-off restarting failed container"}
            }
            last = {
                "terminated": {
                    "reason": "Error",
                    "exitCode": 1,
                    "startedAt": now,
                    "finishedAt": now,
                    "message": self.messages.get(pod.metadata.name, ""),
                }
            }
            restarts = 3
        else:
            state, last, restarts = {"running": {"startedAt": now}}, {}, 0
        return {
            "status": {
                "phase": "Running",
                "podIP": "127.0.0.1",
                "startTime": now,
                "conditions": [
                    {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                    {"type": "ContainersReady", "status": flag, "lastTransitionTime": now},
                    {"type": "Ready", "status": flag, "lastTransitionTime": now},
                ],
                "containerStatuses": container_statuses(pod, lambda c: state, ready, restarts, last),
            }
        }
