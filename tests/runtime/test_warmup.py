"""Warm-up progress lines and counts (pure: a fake clock)."""

from spyre_runtime.warmup import WarmupProgress


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
