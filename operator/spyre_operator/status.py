"""Status as a pure function of what was observed, in kstatus conventions so Argo CD and Flux read health
correctly: `observedGeneration`, `Ready` (set from the first reconcile), the abnormal-true `Reconciling` (the
spec is not fully rolled out yet) and `Stalled` (progress needs a human: invalid spec, a request the API
server refused, a failed compile, pods that crash or never pull), and the older `Progressing` / `Degraded`.
The status is replaced as a whole and written only when it changed."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from spyre_operator.plan import PodView

CONDITION_TYPES = ("Ready", "Reconciling", "Stalled", "Progressing", "Degraded")
# container waiting reasons that never resolve by waiting; replaced after a grace period
STUCK_REASONS = (
    "ImagePullBackOff",
    "ErrImagePull",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
)


@dataclass(frozen=True)
class PodHealth:
    """Failures read off one pod's status."""

    name: str
    failure_reason: str | None = None  # CrashLoop | ContainerFailed | PodFailed | one of STUCK_REASONS
    failure_message: str = ""
    unschedulable_message: str = ""


@dataclass(frozen=True)
class Problem:
    """Something that went wrong while acting (an API error, a refused object) or was seen (a failing
    pod): a reason, a message naming the object, and whether progress needs a human (Stalled)."""

    reason: str
    message: str
    is_stalled: bool = True


def _last_line(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _age_seconds(created: str, now: datetime.datetime) -> float:
    try:
        then = datetime.datetime.strptime(created, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    except ValueError:
        return 0.0
    return (now - then).total_seconds()


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
            words = _last_line(last.get("message"))
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
            words = _last_line(terminated.get("message"))
            message = (
                f"pod {meta['name']}: container {cs['name']} exited: {terminated.get('reason', 'Error')} "
                f"(code {terminated.get('exitCode')})" + (f": {words}" if words else "")
            )
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
        lacks_cards=f"Insufficient {card_resource}" in unschedulable,
        created=meta.get("creationTimestamp") or "",
        node=(pod.get("spec") or {}).get("nodeName") or "",
        dead_reason=dead,
    )
    return view, PodHealth(meta["name"], failure, message, unschedulable)


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class CacheState:
    """The compile Job of the current cache key, as observed."""

    key: str
    is_ready: bool
    is_failed: bool
    reason: str
    message: str
    attempt: int = 1
    max_attempts: int = 1
    failed_at: str = ""  # when the current attempt failed

    @property
    def can_retry(self) -> bool:
        return self.is_failed and self.attempt < self.max_attempts


def observe_job(
    job: dict | None, key: str, max_attempts: int = 1, attempt_annotation: str = ""
) -> CacheState:
    """Reads a compile Job's status (None: not created yet)."""
    if job is None:
        return CacheState(key, False, False, "Compiling", f"creating the compile Job for cache key {key}")
    status = job.get("status") or {}
    name = job["metadata"]["name"]
    try:
        attempt = int((job["metadata"].get("annotations") or {}).get(attempt_annotation, 1))
    except ValueError:
        attempt = 1
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    failed = conditions.get("Failed", {})
    if status.get("succeeded"):
        return CacheState(key, True, False, "Compiled", f"compile Job {name} filled the cache for key {key}")
    if failed.get("status") == "True":
        reason = failed.get("reason") or "JobFailed"
        detail = failed.get("message") or "the compile Job failed"
        tail = (
            f"attempt {attempt} of {max_attempts}, retrying with back-off"
            if attempt < max_attempts
            else f"failed {attempt} of {max_attempts} attempts: fix the cause, then delete the Job to retry"
        )
        return CacheState(
            key,
            False,
            True,
            "CompileJobFailed",
            f"compile Job {name} failed ({reason}): {detail} ({tail})",
            attempt,
            max_attempts,
            failed.get("lastTransitionTime") or "",
        )
    return CacheState(
        key,
        False,
        False,
        "Compiling",
        f"compile Job {name} is filling the cache for key {key}"
        + (f" (attempt {attempt} of {max_attempts})" if attempt > 1 else ""),
        attempt,
        max_attempts,
    )


def condition(type_: str, status: bool, reason: str, message: str) -> dict:
    return {"type": type_, "status": "True" if status else "False", "reason": reason, "message": message}


def compute_status(**kwargs) -> dict:
    """Everything but lastTransitionTime, which `merge_conditions` carries over from the old status."""
    status = _compute_status(**kwargs)
    for c in status["conditions"]:
        c["observedGeneration"] = kwargs["generation"]
    return status


def _compute_status(
    *,
    generation: int,
    replicas: int,
    template_hash: str,
    pods: list[PodView],
    health: list[PodHealth],
    selector: str,
    service_address: str | None,
    card_resource: str,
    invalid: str | None = None,
    invalid_reason: str = "InvalidSpec",
    suspended: bool = False,
    cache: CacheState | None = None,
    problems: tuple[Problem, ...] = (),
    waiting: str = "",
    waiting_reason: str = "WaitingForCapacity",
    warming: dict[str, tuple[int, int]] | None = None,
) -> dict:
    warming = warming or {}
    live = [p for p in pods if not p.is_terminating and not p.is_dead]
    current = [p for p in live if p.template_hash == template_hash]
    ready_current = sum(p.is_ready for p in current)
    ready_all = sum(p.is_ready for p in live)
    base = {
        "observedGeneration": generation,
        "replicas": len(live),
        "readyReplicas": ready_all,
        "selector": selector,
    }
    if template_hash:
        base["templateHash"] = template_hash
    if service_address:
        base["serviceAddress"] = service_address
    if invalid:
        return _at_rest(base, "Failed", invalid_reason, invalid, stalled=True)
    if suspended and not problems:
        return _at_rest(
            base, "Suspended", "Suspended", "spec.suspend is true: pods removed, cache and Service kept"
        )
    names = {p.name for p in pods if not p.is_terminating}
    failures = [
        Problem(h.failure_reason, h.failure_message) for h in health if h.failure_reason and h.name in names
    ]
    starving = [h for h in health if f"Insufficient {card_resource}" in h.unschedulable_message]
    done = (
        not suspended
        and len(current) == replicas
        and ready_current == replicas
        and len(live) == replicas
        and not problems
    )
    if done:
        msg = f"{ready_current}/{replicas} replicas ready"
        progressing = condition("Progressing", False, "RolloutComplete", msg)
    elif starving:
        message = starving[0].unschedulable_message + (f"; {waiting}" if waiting else "")
        progressing = condition("Progressing", True, "WaitingForCards", message)
    elif waiting:
        progressing = condition("Progressing", True, waiting_reason, waiting)
    elif (
        len(current) < replicas or len(live) > replicas or any(p.template_hash != template_hash for p in live)
    ):
        progressing = condition(
            "Progressing",
            True,
            "RollingOut",
            f"{ready_current}/{replicas} replicas of the current template ready",
        )
    else:
        progressing = condition(
            "Progressing",
            True,
            "Warming",
            f"{ready_current}/{replicas} replicas ready; the rest are compiling and warming up"
            + "".join(
                f", {name}: compiling {done}/{total}" for name, (done, total) in sorted(warming.items())
            ),
        )
    if cache is not None and not cache.is_ready and not done:
        progressing = condition("Progressing", True, "WaitingForCache", cache.message)
    # what needs a human first, then what the operator is retrying
    all_problems = list(problems) + failures
    if cache is not None and cache.is_failed:
        all_problems.append(Problem(cache.reason, cache.message, is_stalled=not cache.can_retry))
    stalled = next((p for p in all_problems if p.is_stalled), None)
    worst = stalled or (all_problems[0] if all_problems else None)
    if worst is not None:
        degraded = condition("Degraded", True, worst.reason, worst.message)
    else:
        degraded = condition("Degraded", False, "AsExpected", "no pod is failing")
    if replicas == 0 and not problems:
        ready = condition("Ready", True, "ScaledToZero", "replicas is 0")
    elif done:
        ready = condition("Ready", True, "AllReplicasReady", f"{ready_current}/{replicas} replicas ready")
    else:
        reason = worst.reason if worst else progressing["reason"]
        detail = f"{ready_current}/{replicas} replicas ready" + (f"; {worst.message}" if worst else "")
        ready = condition("Ready", False, reason, detail)
    is_done = done or (replicas == 0 and not problems)
    if stalled is not None:
        stalled_c = condition("Stalled", True, stalled.reason, stalled.message)
    else:
        stalled_c = condition("Stalled", False, "AsExpected", "nothing needs a human")
    if is_done:
        reconciling = condition("Reconciling", False, "RolloutComplete", progressing["message"])
    elif stalled is not None:
        reconciling = condition("Reconciling", False, stalled.reason, "stalled: " + stalled.message)
    elif worst is not None:
        reconciling = condition("Reconciling", True, worst.reason, "retrying: " + worst.message)
    else:
        reconciling = condition("Reconciling", True, progressing["reason"], progressing["message"])
    phase = "Ready" if is_done else "Degraded" if worst is not None else progressing["reason"]
    if suspended:
        phase = "Suspended"
    conditions = [ready, reconciling, stalled_c, progressing, degraded]
    if cache is not None:
        base["cacheKey"] = cache.key
        conditions.append(condition("CacheReady", cache.is_ready, cache.reason, cache.message))
    return {**base, "phase": phase, "conditions": conditions}


def _at_rest(base: dict, phase: str, reason: str, message: str, stalled: bool = False) -> dict:
    """A model the operator does not roll out (invalid or suspended): not Ready, not Progressing."""
    return {
        **base,
        "phase": phase,
        "conditions": [
            condition("Ready", False, reason, message),
            condition("Reconciling", False, reason, message),
            condition("Stalled", stalled, reason, message),
            condition("Progressing", False, reason, message),
            condition("Degraded", stalled, reason, message),
        ],
    }


def merge_conditions(new: dict, old: dict | None) -> dict:
    """Keeps lastTransitionTime of conditions whose status did not change; stamps the others."""
    old_by_type = {c["type"]: c for c in (old or {}).get("conditions") or []}
    merged = []
    for c in new["conditions"]:
        prev = old_by_type.get(c["type"])
        stamp = (
            prev["lastTransitionTime"]
            if prev and prev.get("status") == c["status"] and prev.get("lastTransitionTime")
            else now_iso()
        )
        merged.append({**c, "lastTransitionTime": stamp})
    return {**new, "conditions": merged}


def status_changed(new: dict, old: dict | None) -> bool:
    return _comparable(new) != _comparable(old or {})


def _comparable(status: dict) -> dict:
    out = {k: v for k, v in status.items() if k != "conditions"}
    out["conditions"] = [
        {k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status.get("conditions") or []
    ]
    return out
