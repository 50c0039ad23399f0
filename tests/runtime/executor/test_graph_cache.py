"""The compiled-graph cache: entries, manifest checks, catalog and load slots on real files (no model), and
`spyre-runtime compile` / `generate` as subprocesses sharing a cache directory with real inductor compiles."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from spyre_runtime.executor.graph_cache import GraphCache, load_slot

from tests.cluster.controlplane import Proc, terminate

CONFIGURATION = {"backend": "inductor", "shapes": {"mode": "static"}}


def make_work(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    (work / "fxgraph" / "ab").mkdir(parents=True)
    (work / "fxgraph" / "ab" / "entry").write_bytes(b"graph" * 100)
    (work / "kernel.so").write_bytes(os.urandom(4096))
    (work / "stale.lock").write_text("")
    return work


def test_model_file_digest_is_remembered_until_the_file_changes(tmp_path, monkeypatch):
    """The weights' sha256 (part of the key) is hashed once per file identity and remembered in the cache's
    digests/: a warm start reads it instead of hashing hundreds of MB again; a rewritten file, a damaged
    memo or a read-only cache never give a wrong digest."""
    import hashlib

    from spyre_runtime.executor import graph_key

    weights = tmp_path / "model" / "model.safetensors"
    weights.parent.mkdir()
    weights.write_bytes(os.urandom(100_000))
    memo = tmp_path / "cache" / "digests"
    hashed = []
    real = graph_key._sha256_file
    monkeypatch.setattr(graph_key, "_sha256_file", lambda p: hashed.append(p) or real(p))

    def digest():
        return graph_key.model_file_digest(weights, memo)

    first = digest()
    assert first == hashlib.sha256(weights.read_bytes()).hexdigest() and len(hashed) == 1
    assert digest() == first and len(hashed) == 1  # remembered: not hashed again
    (memo_file,) = memo.iterdir()
    memo_file.write_text("not a digest")
    assert digest() == first and len(hashed) == 2  # a damaged memo is hashed again and rewritten
    assert digest() == first and len(hashed) == 2
    # rewritten in place with the same size and its modification time set back (as `cp -p` or `rsync -a`
    # would): only the change time tells, and it is part of the identity
    st = weights.stat()
    time.sleep(0.01)
    weights.write_bytes(os.urandom(100_000))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (weights.stat().st_ino, weights.stat().st_size, weights.stat().st_mtime_ns) == (
        st.st_ino,
        st.st_size,
        st.st_mtime_ns,
    )
    changed = digest()
    assert changed == hashlib.sha256(weights.read_bytes()).hexdigest() != first and len(hashed) == 3
    other = weights.with_name("more.safetensors")
    other.write_bytes(b"x" * 10)
    before = set(memo.iterdir())

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:  # a full or read-only cache volume: the digest, and nothing left behind
        m.setattr(Path, "write_text", full_disk)
        assert graph_key.model_file_digest(other, memo) == hashlib.sha256(b"x" * 10).hexdigest()
    assert set(memo.iterdir()) == before
    assert graph_key.model_file_digest(weights, None) == changed  # no cache: hashed, nothing kept


def test_publish_then_hit_and_catalog(tmp_path):
    cache = GraphCache(tmp_path / "cache", "inductor-k1", CONFIGURATION)
    assert not cache.is_valid()
    assert cache.publish(make_work(tmp_path))
    assert cache.is_valid()
    assert sorted(p.name for p in cache.entry.rglob("*") if p.is_file()) == [
        "entry",
        "kernel.so",
        "manifest.json",
    ]
    copy = tmp_path / "private"
    cache.copy_to(copy)
    assert (copy / "kernel.so").read_bytes() == (tmp_path / "work" / "kernel.so").read_bytes()
    assert not (copy / "manifest.json").exists()
    catalog = json.loads((tmp_path / "cache" / "catalog.json").read_text())["entries"]["inductor-k1"]
    assert catalog["configuration"] == CONFIGURATION and catalog["size_bytes"] == 500 + 4096
    assert catalog["created"] == catalog["last_used"]
    # a second publisher of the same key loses the race harmlessly: the first entry is kept
    assert not GraphCache(tmp_path / "cache", "inductor-k1", CONFIGURATION).publish(make_work(tmp_path / "b"))
    assert cache.is_valid() and not list((tmp_path / "cache" / "tmp").iterdir())


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_corrupt_entry_is_detected_moved_aside_and_rebuilt(tmp_path, damage, caplog):
    cache = GraphCache(tmp_path / "cache", "inductor-k2", CONFIGURATION)
    cache.publish(make_work(tmp_path))
    kernel = cache.entry / "kernel.so"
    if damage == "truncate":
        kernel.write_bytes(kernel.read_bytes()[:100])
    elif damage == "flip":
        data = bytearray(kernel.read_bytes())
        data[7] ^= 0xFF
        kernel.write_bytes(bytes(data))
    elif damage == "delete":
        kernel.unlink()
    else:
        (cache.entry / "manifest.json").write_text('{"key": "inductor-k2", "fil')
    assert not cache.is_valid()
    assert "is corrupt" in caplog.text
    assert not cache.entry.exists() and len(list((tmp_path / "cache" / "corrupt").iterdir())) == 1
    assert cache.publish(make_work(tmp_path / "again")) and cache.is_valid()


def test_half_written_entry_in_tmp_is_never_taken(tmp_path):
    # what a process killed mid-publish leaves: files in tmp/, no rename into entries/
    cache = GraphCache(tmp_path / "cache", "inductor-k3", CONFIGURATION)
    partial = tmp_path / "cache" / "tmp" / "inductor-k3.999.deadbeef"
    partial.mkdir(parents=True)
    (partial / "kernel.so").write_bytes(b"half")
    assert not cache.is_valid()
    assert cache.publish(make_work(tmp_path)) and cache.is_valid()


def _hold_slot(slots_dir, num_slots, out_path, seconds, ready):
    ready.wait(timeout=120)  # every holder's imports done: all ask at once, not as each start-up ends
    with load_slot(Path(slots_dir), num_slots, poll_seconds=0.02):
        start = time.monotonic()
        time.sleep(seconds)
        end = time.monotonic()
    with open(out_path, "a") as f:
        f.write(f"{start} {end}\n")


@pytest.mark.parametrize("num_slots", [1, 2])
def test_load_slots_bound_concurrent_holders(tmp_path, num_slots):
    """Four processes that ask at the same instant (a barrier; rehearsal 127, on a loaded machine, saw four
    spawned holders start so far apart that two slots never had two holders) never exceed the slots, and
    fill them."""
    ctx = multiprocessing.get_context("spawn")
    out = tmp_path / "spans"
    ready = ctx.Barrier(4)
    args = (tmp_path / "slots", num_slots, out, 0.6, ready)
    procs = [ctx.Process(target=_hold_slot, args=args) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=150)
    spans = [tuple(map(float, line.split())) for line in out.read_text().splitlines()]
    assert len(spans) == 4
    # the most holders at any instant (sampled at every start)
    most = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
    assert most == num_slots


# ---- subprocesses: real compiles ---------------------------------------------------------------


def runtime_env(cache_dir: Path, new_tokens: int, **extra) -> dict:
    """The processes' temporary folder (TMPDIR: their private inductor caches go there) is `tmp` beside the
    cache, so none is left in /tmp and a test can see what is left."""
    tmp = cache_dir.parent / "tmp"
    tmp.mkdir(exist_ok=True)
    return {
        **os.environ,
        "SENDNN_INFERENCE_DYNAMO_BACKEND": "inductor",
        "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "64",
        "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": str(new_tokens),
        "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "2",
        "TORCH_SENDNN_CACHE_ENABLE": "1",
        "TORCH_SENDNN_CACHE_DIR": str(cache_dir),
        "TMPDIR": str(tmp),
        **extra,
    }


def spyre(*args, env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "spyre_runtime.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def compile_summary(res: subprocess.CompletedProcess) -> dict:
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_warm_start_compiles_nothing_and_gives_identical_outputs(tiny_model, tmp_path):
    cache = tmp_path / "cache"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps({"prompt": p, "max_tokens": 8, "ignore_eos": True}) for p in ["Hello there", "1 2 3"]
        )
    )
    env = runtime_env(cache, 8)
    tmp = tmp_path / "tmp"  # the processes' temporary folder (runtime_env)
    cold = spyre("generate", str(tiny_model), "--prompts", str(prompts), env=env)
    assert cold.returncode == 0, cold.stderr[-3000:]
    assert "Graph cache miss" in cold.stderr and "Published graph cache entry" in cold.stderr
    warm = spyre(
        "generate",
        str(tiny_model),
        "--prompts",
        str(prompts),
        env={**env, "SENDNN_INFERENCE_REQUIRE_PRECOMPILED_DECODERS": "1"},
    )
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert "Graph cache hit" in warm.stderr and "; 0 graphs compiled" in warm.stderr
    assert warm.stdout == cold.stdout and len(warm.stdout.splitlines()) == 2
    # each process made a private inductor cache (filled from the entry when warm) and removed it at exit
    # (inductor's own default cache, where the vector-ISA probes stay, shows the folder was theirs)
    assert list(tmp.glob("torchinductor_*"))
    assert not list(tmp.glob("spyre-inductor-*")), sorted(p.name for p in tmp.iterdir())
    (key,) = json.loads((cache / "catalog.json").read_text())["entries"]
    assert key.startswith("inductor-")
    # strict mode with another configuration (other shapes -> other key): fails fast, naming the key
    strict = spyre(
        "serve",
        str(tiny_model),
        env={**runtime_env(cache, 9), "SENDNN_INFERENCE_REQUIRE_PRECOMPILED_DECODERS": "1"},
    )
    assert strict.returncode == 2
    # besides the start-up line naming the warm-up shapes' static batching (1.x's mode), one line: the refusal
    info, line = strict.stderr.strip().splitlines()
    assert "sendnn-inference 1.x's mode" in info
    assert "has no entry for key inductor-" in line and key not in line


def test_killed_compiler_leaves_nothing_and_concurrent_compilers_compile_once(tiny_model, tmp_path):
    cache = tmp_path / "cache"
    env = runtime_env(cache, 12)
    tmp = tmp_path / "tmp"  # the processes' temporary folder (runtime_env)
    log_path = tmp_path / "killed.log"
    with log_path.open("wb") as log:
        victim = subprocess.Popen(
            [sys.executable, "-m", "spyre_runtime.cli", "compile", str(tiny_model)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            # the private inductor folder appears under the key's lock when the compile starts (after
            # inductor's vector-ISA probes, compiled first in this empty temporary folder)
            deadline = time.monotonic() + 300
            while not any(tmp.glob("spyre-inductor-*")):
                assert victim.poll() is None and time.monotonic() < deadline, log_path.read_text()[-2000:]
                time.sleep(0.05)
            time.sleep(2.0)  # mid-compile
            victim.send_signal(signal.SIGKILL)
            victim.wait(timeout=30)
        finally:
            terminate(Proc("compile", victim.pid, log_path, victim))
    assert not (cache / "entries").exists() or not any((cache / "entries").iterdir())
    # two compilers of the same key at once: one compiles, the other waits for it and loads its entry
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "spyre_runtime.cli", "compile", str(tiny_model)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            terminate(Proc("compile", p.pid, tmp_path / "x.log", p))
    summaries = sorted(
        (
            compile_summary(subprocess.CompletedProcess([], p.returncode, o, e))
            for p, (o, e) in zip(procs, outs, strict=True)
        ),
        key=lambda s: s["cache"],
    )
    assert [s["cache"] for s in summaries] == ["hit", "miss"]
    assert summaries[0]["graphs_compiled"] == 0 and summaries[1]["graphs_compiled"] >= 2
    assert summaries[0]["key"] == summaries[1]["key"]
    # the two that exited removed their private inductor caches; only the killed one's is left
    assert len(list(tmp.glob("spyre-inductor-*"))) == 1
