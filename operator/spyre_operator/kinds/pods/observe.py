"""What the operator reads off the model's pods: each pod as a PodView (what the plan needs) and a PodHealth
(its failures, for the conditions). Pure functions of bodies."""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass

from spyre_operator.kinds.pods.plan import PodView
from spyre_operator.settings import HASH_LABEL, OperatorSettings

# container waiting reasons that never resolve by waiting; replaced after a grace period
STUCK_REASONS = (
    "ImagePullBackOff",
    "ErrImagePull",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
)


# what the scheduler says of a pod that lacks cards: too few of the extended resource, or devices (DRA)
DRA_SHORTAGE = "cannot allocate all claims"
# ... and of a pod whose claim does not exist (yet) or is not bound
MISSING_CLAIM = re.compile(
    r'(persistentvolumeclaim|resourceclaim)s? "[^"]*" not found|unbound immediate PersistentVolumeClaims',
    re.I,
)


@dataclass(frozen=True)
class PodHealth:
    """Failures and start-up read off one pod's status."""

    name: str
    failure_reason: str | None = None  # CrashLoop | ContainerFailed | PodFailed | NotReady | STUCK_REASONS
    failure_message: str = ""
    unschedulable_message: str = ""
    node: str = ""  # the node the pod is bound to ("": not scheduled)
    is_started: bool = False  # a container ran (running, or terminated at least once)
    bound_seconds: float = 0.0  # since it was bound to its node
    waiting_reason: str = ""  # its first waiting container's reason (ContainerCreating, ...)

    @property
    def is_bound_not_started(self) -> bool:
        return bool(self.node) and not self.is_started


def lacks_cards(unschedulable_message: str, card_resource: str) -> bool:
    return f"Insufficient {card_resource}" in unschedulable_message or DRA_SHORTAGE in unschedulable_message


def waits_for_claim(unschedulable_message: str) -> bool:
    return bool(MISSING_CLAIM.search(unschedulable_message))


def last_line(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _start_facts(pod: dict, conditions: dict, now: datetime.datetime) -> dict:
    """Where a pod stands before its containers run: bound to which node, for how long, started or not."""
    status = pod.get("status") or {}
    statuses = status.get("containerStatuses") or []
    states = [cs.get("state") or {} for cs in statuses]
    is_started = status.get("phase") in ("Running", "Succeeded", "Failed") or any(
        "running" in s or "terminated" in s or (cs.get("lastState") or {}).get("terminated")
        for s, cs in zip(states, statuses, strict=True)
    )
    bound_at = conditions.get("PodScheduled", {}).get("lastTransitionTime") or (
        pod["metadata"].get("creationTimestamp") or ""
    )
    waiting = next((s["waiting"].get("reason", "") for s in states if "waiting" in s), "")
    return {
        "node": (pod.get("spec") or {}).get("nodeName") or "",
        "is_started": is_started,
        "bound_seconds": _age_seconds(bound_at, now),
        "waiting_reason": waiting,
    }


def _age_seconds(created: str, now: datetime.datetime) -> float:
    then = _timestamp(created)
    return 0.0 if then == _NO_TIME else (now - then).total_seconds()


def _failing_readiness(name: str, status: dict, conditions: dict) -> tuple[str | None, str]:
    """("NotReady", message) for a pod whose container passed its startup probe (warm: it answered /health)
    and was Ready, then fails its readiness probe: the pod lost Ready after the container started. A pod
    between its startup probe and its first readiness probe lost nothing (Ready has been False since before
    the container started). (None, "") otherwise."""
    ready = conditions.get("Ready", {})
    if ready.get("status") != "False" or not ready.get("lastTransitionTime"):
        return None, ""
    for cs in status.get("containerStatuses") or []:
        started_at = ((cs.get("state") or {}).get("running") or {}).get("startedAt")
        if (
            cs.get("started")
            and not cs.get("ready")
            and started_at
            and _timestamp(ready["lastTransitionTime"]) > _timestamp(started_at)
        ):
            return "NotReady", (
                f"pod {name}: container {cs['name']} passed its startup probe but fails its readiness "
                f"probe (not Ready since {ready['lastTransitionTime']}; its Service sends it nothing)"
            )
    return None, ""


_NO_TIME = datetime.datetime.min.replace(tzinfo=datetime.UTC)  # an unreadable timestamp


def _timestamp(text: str) -> datetime.datetime:
    """A Kubernetes timestamp (UTC, seconds); _NO_TIME when it cannot be read."""
    try:
        return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    except ValueError:
        return _NO_TIME


def observe_pod(
    pod: dict,
    card_resource: str,
    hash_label: str,
    now: datetime.datetime | None = None,
    stuck_grace_seconds: float = 120.0,
) -> tuple[PodView, PodHealth]:
    meta, status = pod["metadata"], pod.get("status") or {}
    now = now or datetime.datetime.now(datetime.UTC)
    conditions = {c["type"]: c for c in status.get("conditions") or []}
    ready = conditions.get("Ready", {}).get("status") == "True"
    scheduled = conditions.get("PodScheduled", {})
    unschedulable = ""
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        unschedulable = scheduled.get("message", "")
    failure, message, dead = None, "", ""
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        terminated = (cs.get("state") or {}).get("terminated") or {}
        last = (cs.get("lastState") or {}).get("terminated") or {}
        if waiting.get("reason") == "CrashLoopBackOff":
            failure = "CrashLoop"
            words = last_line(last.get("message"))
            message = (
                f"pod {meta['name']}: container {cs['name']} is crash-looping (last exit: "
                f"{last.get('reason', 'unknown')}, code {last.get('exitCode', '?')}, restarts "
                f"{cs.get('restartCount', 0)})" + (f": {words}" if words else "")
            )
        elif waiting.get("reason") in STUCK_REASONS:
            failure = waiting["reason"]
            message = (
                f"pod {meta['name']}: container {cs['name']} cannot start ({waiting['reason']}, image "
                f"{cs.get('image', '?')}): {waiting.get('message', '')}".rstrip(": ")
            )
            if _age_seconds(meta.get("creationTimestamp") or "", now) > stuck_grace_seconds:
                dead = f"stuck in {waiting['reason']} for more than {stuck_grace_seconds:.0f} s"
        elif terminated and terminated.get("exitCode", 0) != 0:
            failure = "ContainerFailed"
            words = last_line(terminated.get("message"))
            message = (
                f"pod {meta['name']}: container {cs['name']} exited: {terminated.get('reason', 'Error')} "
                f"(code {terminated.get('exitCode')})" + (f": {words}" if words else "")
            )
    if failure is None and not meta.get("deletionTimestamp"):
        failure, message = _failing_readiness(meta["name"], status, conditions)
    phase = status.get("phase")
    if phase in ("Failed", "Succeeded"):
        why = " ".join(x for x in (status.get("reason"), status.get("message")) if x) or f"phase {phase}"
        dead = f"pod ended ({phase}): {why}"
        if failure is None:
            failure, message = "PodFailed", f"pod {meta['name']} ended ({phase}): {why}"
    view = PodView(
        name=meta["name"],
        template_hash=(meta.get("labels") or {}).get(hash_label, ""),
        is_ready=ready and not dead,
        is_terminating=bool(meta.get("deletionTimestamp")),
        lacks_cards=lacks_cards(unschedulable, card_resource),
        created=meta.get("creationTimestamp") or "",
        node=(pod.get("spec") or {}).get("nodeName") or "",
        dead_reason=dead,
    )
    return view, PodHealth(
        meta["name"], failure, message, unschedulable, **_start_facts(pod, conditions, now)
    )


def observe_pods(
    pods: list[dict], settings: OperatorSettings, card_resource: str
) -> list[tuple[PodView, PodHealth]]:
    """`observe_pod` of each pod, with the model's card resource and the settings' grace period."""
    return [
        observe_pod(p, card_resource, HASH_LABEL, stuck_grace_seconds=settings.stuck_grace_seconds)
        for p in pods
    ]
