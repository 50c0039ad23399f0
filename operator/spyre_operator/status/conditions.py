"""Status as a pure function of what was observed, in kstatus conventions so Argo CD and Flux read health
correctly: `observedGeneration`, `Ready` (set from the first reconcile), the abnormal-true `Reconciling` (the
spec is not fully rolled out yet) and `Stalled` (progress needs a human: invalid spec, a request the API
server refused, a failed compile, pods that crash or never pull), and the older `Progressing` / `Degraded`.
The status is replaced as a whole and written only when it changed."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from spyre_operator.io.work import Problem
from spyre_operator.kinds.compile_job import CacheState
from spyre_operator.kinds.inference_pool import PoolState
from spyre_operator.kinds.loader_job import ModelCacheState
from spyre_operator.kinds.pods.observe import PodHealth, lacks_cards, waits_for_claim
from spyre_operator.kinds.pods.plan import PodView

CONDITION_TYPES = ("Ready", "Reconciling", "Stalled", "Progressing", "Degraded")
# pod failures the kubelet may still heal on its own (its liveness probe restarts a pod that stays unready):
# Degraded and Reconciling, not Stalled
HEALING = ("NotReady",)


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, status: bool, reason: str, message: str) -> dict:
    return {"type": type_, "status": "True" if status else "False", "reason": reason, "message": message}


def compute_status(inference_pool: PoolState | None = None, **kwargs) -> dict:
    """Everything but lastTransitionTime, which `merge_conditions` carries over from the old status. A model
    that wants an InferencePool has the condition InferencePoolReady; it does not make the model unready (the
    model serves through its Service either way)."""
    status = _compute_status(**kwargs)
    if inference_pool is not None:
        pool = inference_pool
        status["conditions"].append(condition("InferencePoolReady", pool.is_ready, pool.reason, pool.message))
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
    model_cache: ModelCacheState | None = None,
    problems: tuple[Problem, ...] = (),
    waiting: str = "",
    waiting_reason: str = "WaitingForCapacity",
    warming: dict[str, tuple[int, int]] | None = None,
    start_grace_seconds: float = 300.0,
) -> dict:
    count = _Count.of(pods, replicas, template_hash)
    base = {
        "observedGeneration": generation,
        "replicas": count.live,
        "readyReplicas": count.ready,
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
    is_rolled_out = not suspended and count.is_rolled_out and not problems
    unready = {p.name for p in pods if not p.is_terminating and not p.is_dead and not p.is_ready}
    starving = [h for h in health if lacks_cards(h.unschedulable_message, card_resource)]
    starting = _Starting.of([h for h in health if h.name in unready], start_grace_seconds)
    progressing = _progressing(
        count, is_rolled_out, starving, starting, waiting, waiting_reason, warming or {}
    )
    if cache is not None and not cache.is_ready and not is_rolled_out:
        progressing = condition("Progressing", True, "WaitingForCache", cache.message)
    if model_cache is not None and not model_cache.is_ready and not is_rolled_out:
        progressing = condition("Progressing", True, "WaitingForModel", model_cache.message)
    # what needs a human first, then what the operator is retrying
    seen = _all_problems(problems, pods, health, cache)
    if model_cache is not None and model_cache.is_failed:
        seen.append(Problem(model_cache.reason, model_cache.message))
    stalled = next((p for p in seen if p.is_stalled), None)
    worst = stalled or (seen[0] if seen else None)
    is_done = is_rolled_out or (replicas == 0 and not problems)
    conditions = [
        _ready(count, is_rolled_out, worst, progressing, scaled_to_zero=replicas == 0 and not problems),
        _reconciling(is_done, stalled, worst, progressing),
        _stalled(stalled),
        progressing,
        _degraded(worst),
    ]
    phase = "Ready" if is_done else "Degraded" if worst is not None else progressing["reason"]
    if suspended:
        phase = "Suspended"
    if cache is not None:
        base["cacheKey"] = cache.key
        conditions.append(condition("CacheReady", cache.is_ready, cache.reason, cache.message))
    if model_cache is not None:
        conditions.append(model_cached(model_cache))
    return {**base, "phase": phase, "conditions": conditions}


def model_cached(state: ModelCacheState) -> dict:
    """ModelCached (hf://, s3://): True `Cached` once the loader Job succeeded; False `Downloading` with the
    bytes so far, or `DownloadFailed` with the loader's last words."""
    return condition("ModelCached", state.is_ready, state.reason, state.message)


@dataclass(frozen=True)
class _Count:
    """The rollout in numbers: pods wanted, live (neither terminating nor dead), of the current template,
    and how many of them are Ready."""

    wanted: int
    live: int
    current: int
    ready: int
    ready_current: int
    is_outdated: bool  # a live pod runs another template

    @classmethod
    def of(cls, pods: list[PodView], replicas: int, template_hash: str) -> _Count:
        live = [p for p in pods if not p.is_terminating and not p.is_dead]
        current = [p for p in live if p.template_hash == template_hash]
        return cls(
            wanted=replicas,
            live=len(live),
            current=len(current),
            ready=sum(p.is_ready for p in live),
            ready_current=sum(p.is_ready for p in current),
            is_outdated=any(p.template_hash != template_hash for p in live),
        )

    @property
    def is_rolled_out(self) -> bool:
        return self.current == self.wanted and self.ready_current == self.wanted and self.live == self.wanted


@dataclass(frozen=True)
class _Starting:
    """The live pods that are not Ready, before their containers run: waiting for a claim (the scheduler
    names it), unschedulable for another reason, bound to a node but not started for longer than the grace
    period, or starting; and whether any of them runs (only those warm up)."""

    claim_messages: tuple[str, ...]
    unschedulable: tuple[str, ...]
    stuck: tuple[PodHealth, ...]
    starting: tuple[PodHealth, ...]
    has_running: bool

    @classmethod
    def of(cls, unready: list[PodHealth], grace_seconds: float) -> _Starting:
        not_started = [h for h in unready if not h.is_started]
        stuck = [h for h in not_started if h.is_bound_not_started and h.bound_seconds > grace_seconds]
        return cls(
            claim_messages=tuple(
                h.unschedulable_message for h in unready if waits_for_claim(h.unschedulable_message)
            ),
            unschedulable=tuple(h.unschedulable_message for h in not_started if h.unschedulable_message),
            stuck=tuple(stuck),
            starting=tuple(h for h in not_started if h not in stuck),
            has_running=any(h.is_started for h in unready),
        )

    def stuck_message(self) -> str:
        return "; ".join(
            f"pod {h.name} is bound to node {h.node} and has not started after {h.bound_seconds:.0f} s"
            + (f" ({h.waiting_reason})" if h.waiting_reason else "")
            for h in self.stuck
        )

    def starting_message(self) -> str:
        return ", ".join(
            f"{h.name} on {h.node}" + (f" ({h.waiting_reason})" if h.waiting_reason else "")
            if h.node
            else f"{h.name} (not scheduled yet)"
            for h in self.starting
        )


def _progressing(
    count: _Count,
    is_rolled_out: bool,
    starving: list[PodHealth],
    starting: _Starting,
    waiting: str,
    waiting_reason: str,
    warming: dict[str, tuple[int, int]],
) -> dict:
    """Where the rollout is: complete, waiting (for cards, a claim, pods that do not start or cannot be
    scheduled, or what the operator said), rolling out, starting, or warming up (with each warming pod's
    graphs compiled so far). Only pods whose containers run are ever said to compile."""
    ready_of = f"{count.ready_current}/{count.wanted} replicas"
    if is_rolled_out:
        return condition("Progressing", False, "RolloutComplete", f"{ready_of} ready")
    if starving:
        message = starving[0].unschedulable_message + (f"; {waiting}" if waiting else "")
        return condition("Progressing", True, "WaitingForCards", message)
    if starting.claim_messages:
        return condition("Progressing", True, "WaitingForClaim", starting.claim_messages[0])
    if starting.stuck:
        return condition("Progressing", True, "NotStarted", starting.stuck_message())
    if starting.unschedulable:
        return condition("Progressing", True, "Unschedulable", starting.unschedulable[0])
    if waiting:
        return condition("Progressing", True, waiting_reason, waiting)
    if count.current < count.wanted or count.live > count.wanted or count.is_outdated:
        return condition("Progressing", True, "RollingOut", f"{ready_of} of the current template ready")
    if starting.starting and not starting.has_running:
        return condition(
            "Progressing", True, "Starting", f"{ready_of} ready; starting: {starting.starting_message()}"
        )
    return condition(
        "Progressing",
        True,
        "Warming",
        f"{ready_of} ready; the rest are compiling and warming up"
        + "".join(f", {name}: compiling {done}/{total}" for name, (done, total) in sorted(warming.items())),
    )


def _all_problems(
    problems: tuple[Problem, ...], pods: list[PodView], health: list[PodHealth], cache: CacheState | None
) -> list[Problem]:
    """What went wrong while acting, then the failing pods (not terminating), then a failed compile Job."""
    names = {p.name for p in pods if not p.is_terminating}
    failures = [
        Problem(h.failure_reason, h.failure_message, is_stalled=h.failure_reason not in HEALING)
        for h in health
        if h.failure_reason and h.name in names
    ]
    found = list(problems) + failures
    if cache is not None and cache.is_failed:
        found.append(Problem(cache.reason, cache.message, is_stalled=not cache.can_retry))
    return found


def _ready(
    count: _Count, is_rolled_out: bool, worst: Problem | None, progressing: dict, scaled_to_zero: bool
) -> dict:
    if scaled_to_zero:
        return condition("Ready", True, "ScaledToZero", "replicas is 0")
    ready_of = f"{count.ready_current}/{count.wanted} replicas ready"
    if is_rolled_out:
        return condition("Ready", True, "AllReplicasReady", ready_of)
    reason = worst.reason if worst else progressing["reason"]
    return condition("Ready", False, reason, ready_of + (f"; {worst.message}" if worst else ""))


def _reconciling(is_done: bool, stalled: Problem | None, worst: Problem | None, progressing: dict) -> dict:
    """kstatus' abnormal-true condition: True while the operator still works towards the spec."""
    if is_done:
        return condition("Reconciling", False, "RolloutComplete", progressing["message"])
    if stalled is not None:
        return condition("Reconciling", False, stalled.reason, "stalled: " + stalled.message)
    if worst is not None:
        return condition("Reconciling", True, worst.reason, "retrying: " + worst.message)
    return condition("Reconciling", True, progressing["reason"], progressing["message"])


def _stalled(stalled: Problem | None) -> dict:
    """kstatus' abnormal-true condition: True when progress needs a human."""
    if stalled is not None:
        return condition("Stalled", True, stalled.reason, stalled.message)
    return condition("Stalled", False, "AsExpected", "nothing needs a human")


def _degraded(worst: Problem | None) -> dict:
    if worst is not None:
        return condition("Degraded", True, worst.reason, worst.message)
    return condition("Degraded", False, "AsExpected", "no pod is failing")


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
