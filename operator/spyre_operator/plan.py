"""Decide, then act: `plan_pods(desired, observed)` is pure and table-tested; handlers apply the plan.

Rollout rules:
- pods of the current template are created up to `replicas` (surge: old pods keep serving meanwhile);
- an old pod leaves only when enough current pods are Ready to keep `replicas` ready pods;
- when a current pod cannot be scheduled for lack of cards, one old pod is removed at a time to free its
  cards (never more than one old pod terminating at once), so a rollout on a full cluster does not deadlock;
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


@dataclass(frozen=True)
class PodPlan:
    create: int = 0
    delete: tuple[str, ...] = ()
    reasons: dict[str, str] = field(default_factory=dict, compare=False)  # pod -> why it is deleted

    @property
    def is_noop(self) -> bool:
        return not self.create and not self.delete


def plan_pods(replicas: int, template_hash: str, pods: list[PodView], suspend: bool = False) -> PodPlan:
    live = [p for p in pods if not p.is_terminating]
    if suspend:
        return PodPlan(0, tuple(p.name for p in live), {p.name: "suspended" for p in live})
    current = [p for p in live if p.template_hash == template_hash]
    old = [p for p in live if p.template_hash != template_hash]
    old_terminating = [p for p in pods if p.is_terminating and p.template_hash != template_hash]
    delete: dict[str, str] = {}

    create = max(0, replicas - len(current))
    if len(current) > replicas:
        # scale down: unready first, then newest first
        extra = sorted(current, key=lambda p: (p.is_ready, _newest_first(p.created)))[
            : len(current) - replicas
        ]
        delete.update({p.name: "scale down" for p in extra})

    # old pods: first the unready ones (they serve nobody), then as many as ready current pods allow
    ready_current = sum(p.is_ready for p in current if p.name not in delete)
    old_sorted = sorted(old, key=lambda p: (p.is_ready, p.created))
    ready_old = sum(p.is_ready for p in old)
    for p in old_sorted:
        if not p.is_ready:
            delete[p.name] = "outdated template (not ready)"
    surplus = ready_current + ready_old - replicas
    for p in (p for p in old_sorted if p.is_ready):
        if surplus <= 0:
            break
        delete[p.name] = "outdated template (replaced by a ready pod)"
        surplus -= 1

    # scarce cards: a current pod is stuck for lack of cards; free one old pod's cards at a time
    starving = any(p.lacks_cards for p in current)
    remaining_old = [p for p in old_sorted if p.name not in delete]
    if (
        starving
        and remaining_old
        and not old_terminating
        and not any(n for n in delete if n in {p.name for p in old})
    ):
        delete[remaining_old[0].name] = "outdated template (freeing cards for its replacement)"
    return PodPlan(create, tuple(delete), delete)


def _newest_first(created: str) -> tuple:
    return tuple(-ord(c) for c in created)
