"""Status as a pure function of what was observed, in kstatus conventions (observedGeneration, Ready,
Progressing, Degraded), so Argo CD and Flux read health correctly. Written only when it changed."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from spyre_operator.plan import PodView

CONDITION_TYPES = ("Ready", "Progressing", "Degraded")


@dataclass(frozen=True)
class PodHealth:
    """Failures read off one pod's status."""

    name: str
    failure_reason: str | None = None  # CrashLoop | ContainerFailed
    failure_message: str = ""
    unschedulable_message: str = ""


def observe_pod(pod: dict, card_resource: str, hash_label: str) -> tuple[PodView, PodHealth]:
    meta, status = pod["metadata"], pod.get("status") or {}
    conditions = {c["type"]: c for c in status.get("conditions") or []}
    ready = conditions.get("Ready", {}).get("status") == "True"
    scheduled = conditions.get("PodScheduled", {})
    unschedulable = ""
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        unschedulable = scheduled.get("message", "")
    failure, message = None, ""
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        terminated = (cs.get("state") or {}).get("terminated") or {}
        last = (cs.get("lastState") or {}).get("terminated") or {}
        if waiting.get("reason") == "CrashLoopBackOff":
            failure = "CrashLoop"
            message = (
                f"container {cs['name']} is crash-looping (last exit: {last.get('reason', 'unknown')}, "
                f"code {last.get('exitCode', '?')}, restarts {cs.get('restartCount', 0)})"
            )
        elif terminated and terminated.get("exitCode", 0) != 0:
            failure = "ContainerFailed"
            message = (
                f"container {cs['name']} exited: {terminated.get('reason', 'Error')} "
                f"(code {terminated.get('exitCode')})"
            )
    if status.get("phase") == "Failed" and failure is None:
        failure, message = (
            "ContainerFailed",
            f"pod failed: {status.get('reason', '')} {status.get('message', '')}".strip(),
        )
    view = PodView(
        name=meta["name"],
        template_hash=(meta.get("labels") or {}).get(hash_label, ""),
        is_ready=ready,
        is_terminating=bool(meta.get("deletionTimestamp")),
        lacks_cards=f"Insufficient {card_resource}" in unschedulable,
        created=meta.get("creationTimestamp") or "",
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


def observe_job(job: dict | None, key: str) -> CacheState:
    """Reads a compile Job's status (None: not created yet)."""
    if job is None:
        return CacheState(key, False, False, "Compiling", f"creating the compile Job for cache key {key}")
    status = job.get("status") or {}
    name = job["metadata"]["name"]
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    failed = conditions.get("Failed", {})
    if status.get("succeeded"):
        return CacheState(key, True, False, "Compiled", f"compile Job {name} filled the cache for key {key}")
    if failed.get("status") == "True":
        reason = failed.get("reason") or "JobFailed"
        detail = failed.get("message") or "the compile Job failed"
        return CacheState(
            key, False, True, "CompileJobFailed", f"compile Job {name} failed ({reason}): {detail}"
        )
    return CacheState(
        key, False, False, "Compiling", f"compile Job {name} is filling the cache for key {key}"
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
    suspended: bool = False,
    cache: CacheState | None = None,
) -> dict:
    live = [p for p in pods if not p.is_terminating]
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
        return _at_rest(base, "Failed", "InvalidSpec", invalid, degraded=True)
    if suspended:
        return _at_rest(
            base, "Suspended", "Suspended", "spec.suspend is true: pods removed, cache and Service kept"
        )
    failures = [h for h in health if h.failure_reason and h.name in {p.name for p in live}]
    starving = [h for h in health if f"Insufficient {card_resource}" in h.unschedulable_message]
    done = len(current) == replicas and ready_current == replicas and len(live) == replicas
    if done:
        msg = f"{ready_current}/{replicas} replicas ready"
        progressing = condition("Progressing", False, "RolloutComplete", msg)
    elif starving:
        progressing = condition("Progressing", True, "WaitingForCards", starving[0].unschedulable_message)
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
            f"{ready_current}/{replicas} replicas ready; the rest are compiling and warming up",
        )
    if cache is not None and not cache.is_ready and not done:
        progressing = condition("Progressing", True, "WaitingForCache", cache.message)
    if failures:
        degraded = condition("Degraded", True, failures[0].failure_reason, failures[0].failure_message)
    elif cache is not None and cache.is_failed:
        degraded = condition("Degraded", True, cache.reason, cache.message)
    else:
        degraded = condition("Degraded", False, "AsExpected", "no pod is failing")
    ready_reason = (
        "AllReplicasReady"
        if done
        else progressing["reason"]
        if progressing["status"] == "True"
        else "NotReady"
    )
    if replicas == 0:
        ready = condition("Ready", True, "ScaledToZero", "replicas is 0")
    else:
        ready = condition("Ready", done, ready_reason, f"{ready_current}/{replicas} replicas ready")
    is_degraded = degraded["status"] == "True"
    phase = "Ready" if done or replicas == 0 else "Degraded" if is_degraded else progressing["reason"]
    conditions = [ready, progressing, degraded]
    if cache is not None:
        base["cacheKey"] = cache.key
        conditions.append(condition("CacheReady", cache.is_ready, cache.reason, cache.message))
    return {**base, "phase": phase, "conditions": conditions}


def _at_rest(base: dict, phase: str, reason: str, message: str, degraded: bool = False) -> dict:
    """A model the operator does not roll out (invalid or suspended): not Ready, not Progressing."""
    return {
        **base,
        "phase": phase,
        "conditions": [
            condition("Ready", False, reason, message),
            condition("Progressing", False, reason, message),
            condition("Degraded", degraded, reason, message),
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
