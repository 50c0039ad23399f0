"""Warm-up: the dummy steps that compile every graph serving can need, before serving (the decoder's static
shapes, or continuous batching's chunk and decode buckets), and their progress, which a person watching a pod
start can follow: one line per compiled graph,
`[Warmup][Decode][3/12] batch_size:4 kv_len:256 took 9.81 s, ETA 88 s`, and the same count for `/health`
(503 with {"warming": {"done": i, "total": N}}) and a Prometheus gauge, so the operator can show it."""

from __future__ import annotations

import contextlib
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
    def __init__(self, total: int = 0, clock=time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self.total = total
        self.done = 0
        self.started = clock()

    def start(self, total: int) -> None:
        with self._lock:
            self.total, self.done, self.started = total, 0, self._clock()

    def step(self, kind: str, shape: str, seconds: float) -> str:
        """Records one graph compiled and warmed; logs and returns its line."""
        with self._lock:
            self.done += 1
            done, total = self.done, max(self.total, self.done)
            elapsed = self._clock() - self.started
        eta = elapsed / done * (total - done)
        line = f"[Warmup][{kind}][{done}/{total}] {shape} took {seconds:.2f} s, ETA {eta:.0f} s"
        log.info(line)
        return line

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"done": self.done, "total": self.total}


def graphs_to_warm(config: RuntimeConfig) -> int:
    """Warm-up's steps (its progress total): prefill and decode of every static shape, or every chunk bucket
    (one step for all with dynamic chunks) and every decode batch bucket (each a step, though the buckets of
    config.dynamic_decode share one graph)."""
    if not config.use_cb:
        return 2 * len(config.shapes)
    return (1 if config.dynamic_chunks else len(config.chunk_buckets)) + len(config.batch_buckets)


def compiled_already(again: bool):
    """A step whose graph an earlier warm-up step compiled: compiling again fails the start."""
    return torch.compiler.set_stance("fail_on_recompile") if again else contextlib.nullcontext()


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
) -> None:
    """Dummy steps on the scratch block only: nothing a request owns is written. `decode_span`: the decode
    buckets that share one graph (config.dynamic_decode), compiled by the first of them; the others must
    not compile."""
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
            # dynamic chunks: one graph, compiled by the first length; the second must not compile
            again = cfg.dynamic_chunks and i > 0
            with compiled_already(again):
                run(*inputs.mixed(step))
            what = f"chunk:{size} pieces:{cfg.prefill_pieces} decode_rows:{rows} kv_len:{kv_max}"
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
        in_span = decode_span is not None and decode_span[0] <= batch <= decode_span[1]
        with compiled_already(shared_graph and in_span):
            run(*inputs.batch_decode(ContinuousStep(batch_size=batch, kv_len=kv_max)))
        shared_graph |= in_span
        progress.step("Decode", f"batch_size:{batch} kv_len:{kv_max}", time.monotonic() - t0)
