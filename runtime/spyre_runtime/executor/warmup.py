"""Warm-up: the dummy steps that compile every graph serving can need, before serving (the decoder's static
shapes, or continuous batching's chunk and decode buckets), and their progress, which a person watching a pod
start can follow: one line per step (a compiled graph, or a bucket that reuses one),
`[Warmup][Decode][3/12] batch_size:4 kv_len:256 took 9.81 s, ETA 88 s`, and the same count for `/health`
(503 with {"warming": {"done": i, "total": N}}) and a Prometheus gauge, so the operator can show it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from spyre_runtime.config import RuntimeConfig, Shape
from spyre_runtime.executor.kv_cache import BLOCK_SIZE, SCRATCH_BLOCK
from spyre_runtime.executor.step_inputs import StepInputs
from spyre_runtime.steps import ContinuousStep, PrefillChunk

log = logging.getLogger("spyre_runtime.executor.warmup")


class WarmupProgress:
    """Warm-up's count of steps and its ETA. A step that runs a graph an earlier step compiled (a decode
    bucket of config.dynamic_decode's span after its first) takes a fraction of a second, so the ETA is the
    mean time of the steps that compiled so far times the compiling steps left (`start`'s `compiling`)."""

    def __init__(self, total: int = 0, clock=time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self.total = self.compiling = total
        self.done = self.compiled = 0
        self.started = clock()

    def start(self, total: int, compiling: int | None = None) -> None:
        """`total` steps, of which `compiling` (default: all) compile a graph."""
        if compiling is not None and not 0 <= compiling <= total:
            raise ValueError(f"WarmupProgress: {compiling} compiling steps of {total}")
        with self._lock:
            self.total, self.compiling = total, total if compiling is None else compiling
            self.done = self.compiled = 0
            self.started = self._clock()

    def step(self, kind: str, shape: str, seconds: float, compiled: bool = True) -> str:
        """Records one warm-up step (`compiled`: it compiled its graph); logs and returns its line."""
        with self._lock:
            self.done += 1
            self.compiled += compiled
            done, total = self.done, max(self.total, self.done)
            left = max(self.compiling - self.compiled, 0)
            elapsed = self._clock() - self.started
        eta = elapsed / max(self.compiled, 1) * left
        line = f"[Warmup][{kind}][{done}/{total}] {shape} took {seconds:.2f} s, ETA {eta:.0f} s"
        log.info(line)
        return line

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"done": self.done, "total": self.total}


def graphs_to_warm(config: RuntimeConfig) -> int:
    """Warm-up's steps (its progress total): prefill and decode of every static shape, or every chunk bucket
    (one step for all with dynamic chunks) and every decode batch bucket (each a step, though the buckets of
    config.dynamic_decode share one graph: `span_reuses`)."""
    if not config.use_cb:
        return 2 * len(config.shapes)
    return (1 if config.dynamic_chunks else len(config.chunk_buckets)) + len(config.batch_buckets)


def in_span(decode_span: tuple[int, int] | None, batch: int) -> bool:
    """Whether decode bucket `batch` runs the span's shared graph (config.dynamic_decode)."""
    return decode_span is not None and decode_span[0] <= batch <= decode_span[1]


def span_reuses(config: RuntimeConfig, decode_span: tuple[int, int] | None) -> int:
    """Warm-up's decode steps that compile nothing: the buckets of `decode_span` after its first."""
    return max(sum(in_span(decode_span, b) for b in config.batch_buckets) - 1, 0)


def run_step(run: Callable, args: tuple, reuse: bool, what: str, again: Callable | None = None) -> bool:
    """Runs one warm-up step; returns whether it compiled. `reuse`: an earlier step compiled its graph (a
    dynamic graph's second chunk length, or a later bucket of the decode span), so it runs under
    fail_on_recompile. Should it compile anyway (a model whose graph specialized on the size the span
    shares), the start goes on: a warning names the step and dynamo's reason, and the step compiles a graph
    of its own, as it would without the span, through `again` (default `run`): with tensor parallelism,
    this rank alone, as the other ranks were sent the step once and run it (their collectives wait for this
    rank's). Warm-up's steps write the scratch block only, and dynamo refuses a frame before it runs, so the
    step runs again from the same state."""
    if not reuse:
        run(*args)
        return True
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            run(*args)
        return False
    except RuntimeError as e:
        if "fail_on_recompile" not in str(e):
            raise
        reason = " ".join(str(e).split("triggered by", 1)[-1].split())
        log.warning("warm-up: %s did not reuse the shared graph, compiling its own (%s)", what, reason[:300])
    (again or run)(*args)
    return True


def warm_static(run: Callable, inputs: StepInputs, shapes, progress: WarmupProgress) -> dict[Shape, float]:
    """A prefill and a decode step of every shape through `run` (the executor's step); seconds per shape."""
    seconds = {}
    for shape in shapes:
        t0 = time.monotonic()
        prompts = [[1] * shape.prompt_len] * shape.batch_size
        run(*inputs.static_prefill(shape, prompts))
        t1 = time.monotonic()
        what = f"batch_size:{shape.batch_size} seq_len:{shape.prompt_len}"
        progress.step("Prefill", what, t1 - t0)
        run(*inputs.static_decode(shape, [shape.prompt_len] * shape.batch_size, [1] * shape.batch_size, 0))
        seconds[shape] = time.monotonic() - t0
        progress.step("Decode", f"{what} new_tokens:{shape.new_tokens}", time.monotonic() - t1)
        log.info("Warmup of shape %s took %.2f s", shape, seconds[shape])
    return seconds


def warm_continuous(
    run: Callable,
    inputs: StepInputs,
    cfg: RuntimeConfig,
    progress: WarmupProgress,
    decode_span: tuple[int, int] | None = None,
    again: Callable | None = None,
) -> None:
    """Dummy steps on the scratch block only: nothing a request owns is written. `decode_span`: the decode
    buckets that share one graph (config.dynamic_decode), compiled by the first of them; the others reuse it
    (`run_step`, whose retry is `again`)."""
    kv_max = inputs.prefill_kv_len
    rows = max(cfg.batch_buckets)
    t0 = time.monotonic()
    scratch = (SCRATCH_BLOCK,) * (kv_max // BLOCK_SIZE)
    for i, size in enumerate(cfg.chunk_lengths):
        if cfg.cp_interleave_steps:  # chunks run as mixed steps, beside the decode of `rows` requests
            # a chunk longer than one sequence holds pieces of several prompts, as serving fills it
            lengths = [min(kv_max, size - start) for start in range(0, size, kv_max)]
            pieces = tuple(PrefillChunk(None, (1,) * n, 0, size, scratch, True) for n in lengths)
            step = ContinuousStep(pieces, batch_size=rows, mixed=True)
            # dynamic chunks: one graph, compiled by the first length; the second reuses it
            what = f"chunk:{size} pieces:{cfg.prefill_pieces} decode_rows:{rows} kv_len:{kv_max}"
            run_step(run, inputs.mixed(step), cfg.dynamic_chunks and i > 0, what, again)
        else:
            run(*inputs.chunk(PrefillChunk(None, (1,) * size, 0, size, scratch, True), kv_max))
            what = f"chunk:{size} kv_len:{kv_max}"
        if cfg.dynamic_chunks and i == 0:
            continue  # the same graph as the next length: one progress step for both
        progress.step("Prefill", what, time.monotonic() - t0)
        t0 = time.monotonic()
    shared_graph = False  # the span's one graph is compiled
    for batch in cfg.batch_buckets:  # paged decode reads live slots: a graph per bucket, or the span's one
        t0 = time.monotonic()
        shares = in_span(decode_span, batch)
        what = f"batch_size:{batch} kv_len:{kv_max}"
        compiled = run_step(
            run,
            inputs.batch_decode(ContinuousStep(batch_size=batch, kv_len=kv_max)),
            shared_graph and shares,
            what,
            again,
        )
        shared_graph |= shares
        progress.step("Decode", what, time.monotonic() - t0, compiled)
