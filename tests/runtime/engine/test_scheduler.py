"""Static-batching scheduler, with no model: table tests of batches formed from queues."""

import pytest
from spyre_runtime.config import Shape
from spyre_runtime.engine.sched.static import StaticScheduler, smallest_fitting_shape
from spyre_runtime.request import Request
from spyre_runtime.sampling.params import SamplingParams

SHAPES = (Shape(64, 20, 1), Shape(64, 20, 4), Shape(128, 64, 2))


def req(rid: str, prompt_tokens: int, max_tokens: int) -> Request:
    return Request(rid, [1] * prompt_tokens, SamplingParams(max_tokens=max_tokens, temperature=0))


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "expected"),
    [
        (10, 5, Shape(64, 20, 1)),
        (64, 20, Shape(64, 20, 1)),
        (65, 20, Shape(128, 64, 2)),
        (10, 21, Shape(128, 64, 2)),
        (129, 1, None),
        (10, 65, None),
    ],
)
def test_smallest_fitting_shape(prompt, max_tokens, expected):
    assert smallest_fitting_shape(SHAPES, prompt, max_tokens) == expected


@pytest.mark.parametrize(
    ("queue", "shape", "batch", "left"),
    [
        # one short request: the smallest batch size that holds it
        ([("a", 10, 5)], Shape(64, 20, 1), ["a"], []),
        # three short ones: batch size 4 holds them
        ([("a", 10, 5), ("b", 30, 20), ("c", 60, 1)], Shape(64, 20, 4), ["a", "b", "c"], []),
        # five short ones: four go, the fifth keeps its place
        ([(x, 10, 5) for x in "abcde"], Shape(64, 20, 4), list("abcd"), ["e"]),
        # the head picks the shape; a long request does not block, and keeps its place
        ([("a", 10, 5), ("long", 100, 30), ("b", 10, 5)], Shape(64, 20, 4), ["a", "b"], ["long"]),
        # a long head goes first in the big shape; a short one that fits it joins
        ([("long", 100, 30), ("a", 10, 5)], Shape(128, 64, 2), ["long", "a"], []),
    ],
)
def test_batches_formed_from_queue(queue, shape, batch, left):
    s = StaticScheduler(SHAPES)
    for rid, p, m in queue:
        s.add(req(rid, p, m))
    step = s.schedule()
    assert step.is_prefill and step.shape == shape
    assert [r.request_id for r in step.requests] == batch
    assert [r.request_id for r in s.waiting] == left


def finish_all(step, reason="length"):
    for r in step.requests:
        r.finish(reason)


def test_no_new_prefill_until_the_batch_finished():
    s = StaticScheduler(SHAPES)
    s.add(req("a", 10, 3))
    s.add(req("b", 10, 1))
    first = s.schedule()
    s.add(req("c", 10, 2))  # arrives while a batch runs
    first.requests[1].finish("length")  # b done after its prefill token
    assert s.update(first) == []
    steps = []
    for t in range(2):
        step = s.schedule()
        steps.append((step.is_prefill, step.decode_index, [r.request_id for r in step.requests]))
        if t == 1:
            step.requests[0].finish("length")
        done = s.update(step)
    assert steps == [(False, 0, ["a", "b"]), (False, 1, ["a", "b"])]
    assert sorted(r.request_id for r in done) == ["a", "b"]
    nxt = s.schedule()
    assert nxt.is_prefill and [r.request_id for r in nxt.requests] == ["c"]


def test_abort_waiting_and_running():
    s = StaticScheduler(SHAPES)
    for rid in "abcde":
        s.add(req(rid, 10, 5))
    step = s.schedule()
    assert s.abort("e").finish_reason == "abort"
    assert list(s.waiting) == []
    assert s.abort("a").finish_reason == "abort"
    assert s.num_running == 3
    assert s.abort("zzz") is None
    finish_all(step)
    assert len(s.update(step)) == 4 and not s.has_work()


def test_request_that_fits_nothing_is_refused():
    s = StaticScheduler(SHAPES)
    with pytest.raises(ValueError, match="fits no compiled shape"):
        s.add(req("x", 200, 5))


def test_the_shape_that_takes_most_waiting_requests_wins():
    shapes = (Shape(128, 128, 8), Shape(256, 128, 8))
    s = StaticScheduler(shapes)
    # a short head would take only the two short requests in the 128 shape; the 256 shape takes all five
    for rid, p in (("a", 50), ("b", 200), ("c", 100), ("d", 250), ("e", 180)):
        s.add(req(rid, p, 64))
    step = s.schedule()
    assert step.shape == Shape(256, 128, 8) and [r.request_id for r in step.requests] == list("abcde")
    # when every member fits the smaller shape, the smaller one is used
    s2 = StaticScheduler(shapes)
    for rid in "xyz":
        s2.add(req(rid, 60, 64))
    assert s2.schedule().shape == Shape(128, 128, 8)
