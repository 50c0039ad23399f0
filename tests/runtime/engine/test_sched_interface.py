"""The scheduler interface (engine/sched/interface.py): every policy implements it, the factory picks the
policy from the configuration, and a policy that leaves out part of the interface cannot be built."""

from pathlib import Path

import pytest
from spyre_runtime.config import RuntimeConfig, Shape
from spyre_runtime.engine.sched.continuous import ContinuousScheduler
from spyre_runtime.engine.sched.factory import make_scheduler
from spyre_runtime.engine.sched.interface import GenerateScheduler, Scheduler
from spyre_runtime.engine.sched.pooling import PoolingScheduler, PoolItem
from spyre_runtime.engine.sched.static import StaticScheduler
from spyre_runtime.request import Request, Status
from spyre_runtime.sampling.params import SamplingParams

SHAPES = (Shape(64, 16, 2),)


def config(**kw) -> RuntimeConfig:
    return RuntimeConfig(model_dir=Path("unused"), served_model_name="t", shapes=SHAPES, **kw)


def test_the_factory_picks_the_policy_from_the_configuration():
    static = make_scheduler(config())
    continuous = make_scheduler(config(use_cb=True, max_model_len=256, max_num_seqs=2))
    assert type(static) is StaticScheduler and type(continuous) is ContinuousScheduler
    for sched in (static, continuous):
        assert isinstance(sched, GenerateScheduler)
        assert not sched.has_work() and sched.num_waiting == sched.num_running == 0
        assert sched.num_prefix_queries == sched.num_prefix_hits == 0


@pytest.mark.parametrize("use_cb", [False, True])
def test_a_generate_request_runs_the_cycle_through_the_interface(use_cb):
    sched: GenerateScheduler = make_scheduler(config(use_cb=use_cb, max_model_len=256, max_num_seqs=2))
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=1, temperature=0))
    sched.add(req)
    assert sched.has_work() and sched.num_waiting == 1
    step = sched.schedule()
    assert req in step.requests and req.status is Status.RUNNING
    req.output_token_ids.append(7)
    req.finish("length")
    assert sched.update(step) == [req]
    assert not sched.has_work() and sched.schedule() is None


def test_a_request_that_can_never_run_is_refused_by_the_shared_admission_check():
    sched = make_scheduler(config())
    with pytest.raises(ValueError, match=r"request big \(100 prompt tokens, max_tokens=1\) fits no compiled"):
        sched.add(Request("big", [1] * 100, SamplingParams(max_tokens=1)))
    assert sched.num_waiting == 0


def test_the_pooling_scheduler_runs_the_same_cycle():
    sched = PoolingScheduler((Shape(16, 0, 2),))
    assert isinstance(sched, Scheduler) and not isinstance(sched, GenerateScheduler)
    items = [PoolItem([1, 2, 3], None, lambda out: None) for _ in range(3)]
    for item in items:
        sched.add(item)
    assert sched.has_work() and sched.num_waiting == 3 and sched.num_running == 0
    step = sched.schedule()
    assert step.items == tuple(items[:2])
    assert sched.update(step) == tuple(items[:2])  # every input of a step finishes with it
    assert sched.num_waiting == 1 and sched.schedule().items == (items[2],)
    assert not sched.has_work()


def test_a_policy_missing_part_of_the_interface_cannot_be_built():
    class Partial(GenerateScheduler):
        def add(self, work):
            pass

    with pytest.raises(TypeError, match="abstract"):
        Partial()
