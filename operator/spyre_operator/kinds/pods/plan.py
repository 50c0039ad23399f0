"""Decide, then act: `plan_pods(desired, observed)` is pure and table-tested; handlers apply the plan.

Rollout rules (`Budget`: surge = pods allowed above `replicas`, unavailable = ready pods allowed below it):
- dead pods (phase Failed or Succeeded: evicted, exited) and pods stuck past their grace period (image never
  pulls, container config missing) are replaced: they serve nobody and hold cards;
- pods of the current template are created up to `replicas`, as far as the surge allows (old pods keep
  serving meanwhile);
- an old pod leaves when it is not ready (it serves nobody), or when enough other pods are Ready to keep
  `replicas` ready pods;
- when a current pod cannot be scheduled for lack of cards (or a quota refused it), one old pod at a time
  is removed to free its cards, and only when (a) no old pod is still terminating, (b) removing it keeps at
  least `replicas - unavailable` pods Ready, and (c) its node could host the waiting pod;
- extra current pods (scale down) leave unready ones first, newest first; `suspend` removes every pod.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PodView:
    """What the plan needs to know of one observed pod."""

    name: str
    template_hash: str
    is_ready: bool = False
    is_terminating: bool = False
    lacks_cards: bool = False  # the scheduler said Insufficient <card resource>
    created: str = ""  # creationTimestamp; ISO strings order in time
    node: str = ""
    dead_reason: str = ""  # non-empty: the pod ended (Failed/Succeeded) or is stuck past its grace period

    @property
    def is_dead(self) -> bool:
        return bool(self.dead_reason)


@dataclass(frozen=True)
class Budget:
    surge: int = 1 << 30
    unavailable: int = 1


@dataclass(frozen=True)
class PodPlan:
    create: int = 0
    delete: tuple[str, ...] = ()
    reasons: dict[str, str] = field(default_factory=dict, compare=False)  # pod -> why it is deleted
    waiting: str = ""  # why the rollout cannot move now (empty: it can)

    @property
    def is_noop(self) -> bool:
        return not self.create and not self.delete


def plan_pods(
    replicas: int,
    template_hash: str,
    pods: list[PodView],
    suspend: bool = False,
    budget: Budget = Budget(),
    can_host: frozenset[str] | None = None,
    quota_blocked: bool = False,
) -> PodPlan:
    """`can_host`: names of old pods whose node could host a pod of the current template once they leave
    (None: any). `quota_blocked`: the last pod creation was refused by a ResourceQuota."""
    alive = [p for p in pods if not p.is_terminating]
    if suspend:
        return PodPlan(0, tuple(p.name for p in alive), {p.name: "suspended" for p in alive})
    delete: dict[str, str] = {p.name: p.dead_reason for p in alive if p.is_dead}
    live = [p for p in alive if not p.is_dead]
    current = [p for p in live if p.template_hash == template_hash]
    old = [p for p in live if p.template_hash != template_hash]

    if len(current) > replicas:
        # scale down: unready first, then newest first
        extra = sorted(current, key=lambda p: (p.is_ready, _newest_first(p.created)))[
            : len(current) - replicas
        ]
        delete.update({p.name: "scale down" for p in extra})

    # old pods: first the unready ones (they serve nobody), then as many as ready pods allow
    old_sorted = sorted(old, key=lambda p: (p.is_ready, p.created))
    for p in old_sorted:
        if not p.is_ready:
            delete[p.name] = "outdated template (not ready)"
    ready = sum(p.is_ready for p in live if p.name not in delete)
    for p in (p for p in old_sorted if p.is_ready):
        if ready - 1 < replicas:
            break
        delete[p.name] = "outdated template (replaced by a ready pod)"
        ready -= 1

    staying = [p for p in live if p.name not in delete]
    current_staying = [p for p in staying if p.template_hash == template_hash]
    room = replicas + budget.surge - len(staying)
    create = max(0, min(replicas - len(current_staying), room))

    waiting = ""
    starving = quota_blocked or any(p.lacks_cards for p in current)
    remaining_old = [p for p in old_sorted if p.name not in delete]
    old_terminating = [p for p in pods if p.is_terminating and p.template_hash != template_hash]
    if starving and remaining_old and not any(p.name in delete for p in old):
        if old_terminating:
            waiting = f"waiting for old pod {old_terminating[0].name} to release its cards"
        else:
            floor = max(0, replicas - budget.unavailable)
            hosts = [p for p in remaining_old if can_host is None or p.name in can_host]
            victim = hosts[0] if hosts else None
            if victim is None:
                waiting = "no old pod runs on a node that could host the new pod (cards, nodeSelector)"
            elif ready - victim.is_ready < floor:
                waiting = (
                    f"removing old pod {victim.name} would leave {ready - victim.is_ready} ready, below "
                    f"the availability budget of {floor} (replicas {replicas} - maxUnavailable "
                    f"{budget.unavailable}); waiting for a new pod to become Ready"
                )
            else:
                delete[victim.name] = "outdated template (freeing cards for its replacement)"
                if floor == 0:
                    waiting = (
                        "no cards for a surge: the replica is replaced in place, so the model is "
                        "unavailable until the new pod is Ready"
                    )
    return PodPlan(create, tuple(delete), delete, waiting)


def _newest_first(created: str) -> tuple:
    return tuple(-ord(c) for c in created)
