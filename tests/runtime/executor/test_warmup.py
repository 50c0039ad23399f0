"""Warm-up progress lines and counts (pure: a fake clock), its progress seen while a server starts, and the
decode buckets that share one graph."""

import pytest
import torch
from spyre_runtime.executor.compiler import cache_tag
from spyre_runtime.executor.warmup import WarmupProgress

from tests.httpclient import HTTP
from tests.runtime.executor.test_hot_path import small_cb


def test_progress_lines_count_graphs_and_estimate_the_rest():
    now = [100.0]
    progress = WarmupProgress(clock=lambda: now[0])
    progress.start(4)
    assert progress.snapshot() == {"done": 0, "total": 4}
    now[0] += 10
    line = progress.step("Prefill", "batch_size:1 seq_len:64", 10.0)
    assert line == "[Warmup][Prefill][1/4] batch_size:1 seq_len:64 took 10.00 s, ETA 30 s"
    now[0] += 30
    line = progress.step("Decode", "batch_size:4 kv_len:256", 30.0)
    assert line == "[Warmup][Decode][2/4] batch_size:4 kv_len:256 took 30.00 s, ETA 40 s"
    assert progress.snapshot() == {"done": 2, "total": 4}


def test_the_eta_counts_the_steps_that_compile_not_those_that_reuse_a_graph():
    """A mixed graph, the 1-row decode graph, then buckets 2..32 sharing one graph (config.dynamic_decode):
    seven steps, of which three compile. The ETA after the first is one more mean step per compiling step
    left, not one per step, and none once nothing is left to compile."""
    now = [0.0]
    progress = WarmupProgress(clock=lambda: now[0])
    progress.start(7, compiling=3)
    lines = []
    for kind, seconds, compiled in [("Prefill", 26, True), ("Decode", 10, True), ("Decode", 12, True)] + [
        ("Decode", 0.05, False)
    ] * 4:
        now[0] += seconds
        lines.append(progress.step(kind, "x", seconds, compiled))
    assert [line.rsplit("ETA ", 1)[1] for line in lines] == ["52 s", "18 s"] + ["0 s"] * 5
    assert lines[-1].startswith("[Warmup][Decode][7/7]")
    with pytest.raises(ValueError, match="8 compiling steps of 7"):
        progress.start(7, compiling=8)


def test_health_and_log_show_warmup_progress_while_the_server_starts(tiny_model, tmp_path):
    import time

    import httpx

    from tests.runtime.serverproc import ServerProcess

    # inductor: compiling takes seconds, so /health is seen mid-way
    env = {
        "SENDNN_INFERENCE_DYNAMO_BACKEND": "inductor",
        "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "64,128",
        "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": "8,8",
        "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "1,1",
    }
    server = ServerProcess(tiny_model, env, tmp_path / "server.log")
    seen = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                r = HTTP.get(server.base + "/health", timeout=2)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            if r.status_code == 200:
                break
            if "warming" in r.json():
                seen.append(r.json()["warming"])
            time.sleep(0.05)
        else:
            raise AssertionError("not ready: " + server.log()[-2000:])
        assert seen and all(s["total"] == 4 for s in seen)  # prefill and decode of two shapes
        assert any(s["done"] < 4 for s in seen)
        metrics = HTTP.get(server.base + "/metrics", timeout=5).text
        assert "spyre_warmup_graphs_done 4.0" in metrics and "spyre_warmup_graphs 4.0" in metrics
        log = server.log()
        assert "[Warmup][Prefill][1/4] batch_size:1 seq_len:64 took" in log
        assert "[Warmup][Decode][4/4] batch_size:1 seq_len:128 new_tokens:8 took" in log and "ETA 0 s" in log
    finally:
        server.stop()


def test_skip_warmup_compiles_on_first_use_and_says_so(tiny_model, tmp_path):
    import json
    import os
    import subprocess
    import sys

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello", "max_tokens": 4}) + "\n")
    # static batching (its one default shape: a prefill and a decode graph to warm)
    env = {**os.environ, "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager", "SENDNN_INFERENCE_USE_CB": "0"}
    argv = [sys.executable, "-m", "spyre_runtime.cli", "generate", str(tiny_model), "--prompts", str(prompts)]
    res = subprocess.run([*argv, "--skip-warmup"], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "warm-up skipped (--skip-warmup)" in res.stderr and "[Warmup]" not in res.stderr
    assert len(res.stdout.splitlines()) == 1
    warmed = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert warmed.returncode == 0 and "[Warmup][Decode][2/2]" in warmed.stderr
    assert json.loads(warmed.stdout)["text"] == json.loads(res.stdout)["text"]


@pytest.mark.parametrize(
    ("backend", "buckets", "span"),
    [
        ("inductor", (1, 2, 4, 8), (2, 8)),
        ("inductor", (8, 32), (8, 32)),
        ("inductor", (1, 4), None),  # one bucket above 1: nothing to share
        ("inductor", (4,), None),
        ("sendnn", (1, 2, 4), None),  # static shapes only
        ("eager", (1, 2, 4), None),  # no graphs
    ],
)
def test_decode_buckets_above_one_share_one_graph_on_inductor(tiny_model, backend, buckets, span):
    cfg = small_cb(tiny_model, backend, max_num_seqs=max(buckets), decode_batch_buckets=buckets)
    assert cfg.dynamic_decode == span
    # inductor's cache key names the span, as it names the mixed graph's token range
    decode_tags = [t for t in cache_tag(cfg).split(";") if t.startswith("spyre-serve-decode")]
    assert decode_tags == (["spyre-serve-decode:{}-{}".format(*span)] if span else [])


def _served(tiny_model, marks: str, tp: int = 1) -> tuple[list[list[int]], int, object]:
    """An engine with decode buckets 1, 2 and 4 (span 2-4) warmed with the span's marks (`span`), with none
    (`none`: a graph per bucket, as before the span), or with marks narrowed to 2-3 on rank 0 while warm-up
    still expects bucket 4 to reuse bucket 2's graph (`narrow`: that step recompiles there; at `tp` 2 the
    other rank keeps the span and reuses it); then four requests that finish one after another, so they
    decode at 4, then 2 (three live rows), then 1. Their greedy tokens, the graphs rank 0 compiled, the
    progress."""
    from spyre_runtime.engine.llm_engine import LLMEngine
    from spyre_runtime.executor.warmup import warm_continuous
    from spyre_runtime.sampling.params import SamplingParams
    from torch._dynamo.utils import counters

    cfg = small_cb(
        tiny_model,
        "inductor",
        max_num_seqs=4,
        decode_batch_buckets=(1, 2, 4),
        kv_len_buckets=(128,),
        tensor_parallel_size=tp,
        max_load_processes=1,
        gloo_timeout_minutes=2,  # ranks a step apart fail in 2 minutes instead of waiting for 60
    )
    engine = LLMEngine(cfg)
    try:
        executor = engine.executor
        assert executor.decode_span == (2, 4)
        counters.clear()
        if marks == "narrow":
            executor.decode_span = (2, 3)
            executor.progress.start(4, compiling=3)
            args = (executor._run, executor.inputs, cfg, executor.progress, (2, 4), executor._run_here)
            warm_continuous(*args)
            executor.is_warm = True
            if executor.workers is not None:
                executor.workers.send("warm")
        else:
            executor.decode_span = None if marks == "none" else executor.decode_span
            executor.warmup()
        graphs = counters["stats"]["unique_graphs"]
        prompts = [[5, 9, 13], [7, 7, 2, 40, 3], [11] * 9, [3, 30]]
        reqs = [
            engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            for p, n in zip(prompts, (4, 7, 12, 16), strict=True)
        ]
        while engine.has_work():
            engine.step()
        return [r.output_token_ids for r in reqs], graphs, executor.progress
    finally:
        engine.close()


def test_one_dynamic_decode_graph_serves_the_tokens_of_a_graph_per_bucket(tiny_model):
    """Inductor, decode buckets 1, 2 and 4: warm-up compiles the mixed graph, the 1-row decode graph and one
    graph for 2 and 4 (the second bucket compiles nothing: warm-up runs it under fail_on_recompile). Their
    greedy tokens equal those of graphs compiled for each bucket alone (an executor whose block groups carry
    no marks), and warm-up's progress counts the steps that compiled."""
    with torch._dynamo.config.patch(recompile_limit=1024, accumulated_recompile_limit=4096):
        shared, shared_graphs, shared_progress = _served(tiny_model, "span")
        per_bucket, per_bucket_graphs, per_bucket_progress = _served(tiny_model, "none")
    assert (shared_graphs, per_bucket_graphs) == (3, 4)
    assert [len(t) for t in shared] == [4, 7, 12, 16]
    assert shared == per_bucket
    # four steps (the mixed graph and three buckets), of which three or four compile
    for progress, compiled in ((shared_progress, 3), (per_bucket_progress, 4)):
        assert (progress.done, progress.total) == (4, 4)
        assert progress.compiling == progress.compiled == compiled


@pytest.mark.parametrize("tp", [1, 2])
def test_a_bucket_that_does_not_reuse_the_span_graph_warns_and_compiles_its_own(tiny_model, caplog, tp):
    """The span's later bucket recompiles (its graph specialized elsewhere): the start goes on, a warning
    names the bucket and dynamo's reason, the bucket gets a graph of its own (4 graphs, as without the span),
    the progress counts it as compiled, and serving at 4, 2 and 1 rows gives the tokens of a graph per
    bucket. With tensor parallelism only rank 0 runs the step again, so the ranks' collectives still pair
    up (a step sent to the other rank twice would leave them a step apart, and the serving steps would
    hang or fail)."""
    with torch._dynamo.config.patch(recompile_limit=1024, accumulated_recompile_limit=4096):
        with caplog.at_level("WARNING", logger="spyre_runtime.executor.warmup"):
            tokens, graphs, progress = _served(tiny_model, "narrow", tp)
        per_bucket, _, _ = _served(tiny_model, "none")
    warnings = [r.getMessage() for r in caplog.records if r.name == "spyre_runtime.executor.warmup"]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("warm-up: batch_size:4 kv_len:128 did not reuse the shared graph")
    assert "2 <= x.size()[0] <= 3" in warnings[0]  # dynamo's failed guard: the marks' range
    assert graphs == 4 and (progress.done, progress.compiled) == (4, 4)
    assert tokens == per_bucket
