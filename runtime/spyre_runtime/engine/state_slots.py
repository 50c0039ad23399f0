"""Per-sequence state slots of a hybrid (Mamba) model: which slot of the executor's Mamba state tensors each
running request owns. No tensors.

A request takes a slot when it is admitted and gives it back when it finishes, is aborted or is preempted
(its state is recomputed when it prefills again). Slot 0 is scratch (padding and dummy rows), so slots
1..num_slots-1 are handed out, lowest first. The scheduler admits at most max_num_seqs requests and there
are max_num_seqs slots, so a slot is always free for an admitted request.
"""

from __future__ import annotations

import heapq


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(1, num_slots))
        self._owner: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self, request_id: str) -> int:
        if request_id in self._owner:
            raise ValueError(f"request {request_id} already holds state slot {self._owner[request_id]}")
        if not self._free:
            raise RuntimeError(f"no free state slot (all {self.num_slots - 1} are held)")
        slot = heapq.heappop(self._free)
        self._owner[request_id] = slot
        return slot

    def free(self, request_id: str) -> None:
        """Gives the request's slot back (nothing when it holds none)."""
        slot = self._owner.pop(request_id, None)
        if slot is not None:
            heapq.heappush(self._free, slot)

    def slot_of(self, request_id: str) -> int | None:
        return self._owner.get(request_id)
