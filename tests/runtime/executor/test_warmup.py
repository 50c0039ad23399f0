"""Warm-up progress lines and counts (pure: a fake clock)."""

from spyre_runtime.executor.warmup import WarmupProgress

from tests.httpclient import HTTP


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
