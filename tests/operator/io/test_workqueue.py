"""The work queue: coalesces, serializes per key, backs off."""

from __future__ import annotations

import threading
import time

from spyre_operator.io.workqueue import Result, WorkQueue


def test_work_queue_coalesces_serializes_and_backs_off():
    seen: list[tuple[str, float]] = []
    running: set[str] = set()
    overlap = []
    fail_first = {"b"}
    gate = threading.Event()

    def process(key):
        if key in running:
            overlap.append(key)
        running.add(key)
        seen.append((key, time.monotonic()))
        if key == "a":
            gate.wait(2)
        running.discard(key)
        if key in fail_first:
            fail_first.discard(key)
            return Result(failed=True)
        return None

    q = WorkQueue(process, workers=3, base_delay=0.3)
    q.start()
    try:
        q.add("a")
        time.sleep(0.1)
        for _ in range(5):  # while "a" runs: coalesced into one more pass
            q.add("a")
        q.add("b")
        time.sleep(0.2)
        gate.set()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (
            sum(k == "a" for k, _ in seen) < 2 or sum(k == "b" for k, _ in seen) < 2
        ):
            time.sleep(0.05)
    finally:
        q.stop()
    assert not overlap
    assert sum(k == "a" for k, _ in seen) == 2
    b_times = [t for k, t in seen if k == "b"]
    assert len(b_times) == 2 and b_times[1] - b_times[0] >= 0.25  # retried after the back-off
    assert q.failures("b") == 0
