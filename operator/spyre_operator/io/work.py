"""What one reconcile pass gathers while it acts: the problems met (they reach the status and fail the pass),
why the rollout waits (the Progressing condition says so), and when to look again."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Problem:
    """Something that went wrong while acting (an API error, a refused object) or was seen (a failing
    pod): a reason, a message naming the object, and whether progress needs a human (Stalled)."""

    reason: str
    message: str
    is_stalled: bool = True


@dataclass
class Pass:
    problems: list[Problem] = field(default_factory=list)
    waiting: str = ""
    waiting_reason: str = "WaitingForCapacity"
    after: float | None = None  # run again in this many seconds

    def later(self, seconds: float) -> None:
        self.after = seconds if self.after is None else min(self.after, seconds)
