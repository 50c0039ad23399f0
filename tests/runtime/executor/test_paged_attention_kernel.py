"""The C++ paged decode-attention kernel (executor/kernels) against the ATen ops it replaces, which stay its
fallback and oracle: a table of block layouts (ragged lengths, windows, sinks, GQA, head sizes, dtypes,
dead rows, a long context split across threads), its errors, its setting and its fallback on a failed
build. The kernel builds on first use (about a minute on a cold cache); on this machine it must build."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from spyre_runtime.executor import kv_cache, linear
from spyre_runtime.executor.kernels import paged_attention
from torch.utils import cpp_extension

REPO = Path(__file__).resolve().parents[3]
BLOCK = kv_cache.BLOCK_SIZE


@pytest.fixture(scope="module")
def kernel():
    op = paged_attention.kernel()
    assert op is not None, "the paged attention kernel did not build here (see the warning logged)"
    return op


LOAD = "from spyre_runtime.executor.kernels import paged_attention\nassert paged_attention.kernel()\n"


def load_in_a_new_process(env: dict, script: str = LOAD) -> subprocess.CompletedProcess:
    """Runs `script` (by default: build or load the kernel) in a fresh interpreter with `env`: exits 0."""
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return done


def shared_build() -> Path:
    """The host's shared build folder (torch's default root), built first if no test has built it yet."""
    load_in_a_new_process({k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"})
    return Path(cpp_extension.get_default_build_root()) / paged_attention.extension_name()


def layout(lens, heads, kvheads, head_dim, dtype, seed=0):
    """Rows of `lens` tokens whose blocks are scattered over a cache full of large garbage (a slot read by
    mistake shows), each row's table padded with scratch block 0 past its blocks."""
    gen = torch.Generator().manual_seed(seed)
    per_row = max(-(-n // BLOCK) for n in lens) + 1
    num_blocks = 1 + len(lens) * per_row
    key_cache = (torch.randn(num_blocks, BLOCK, kvheads, head_dim, generator=gen) * 4).to(dtype)
    value_cache = (torch.randn(num_blocks, BLOCK, kvheads, head_dim, generator=gen) * 4).to(dtype)
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    table = torch.zeros(len(lens), per_row, dtype=torch.long)
    for r, n in enumerate(lens):
        used = -(-n // BLOCK)
        table[r, :used] = order[r * per_row : r * per_row + used]
    query = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    return query, key_cache, value_cache, table, torch.tensor(lens)


def oracle(*args):
    with paged_attention.disabled():
        return kv_cache.paged_decode(*args)


CASES = [  # lens, heads, kv heads, head_dim, window, sinks
    pytest.param([1, 63, 64, 65, 200, 512], 9, 3, 64, 0, False, id="ragged-smollm2"),
    pytest.param([1, 63, 64, 65, 200, 512], 9, 3, 64, 100, False, id="window"),
    pytest.param([5, 64, 128, 511], 8, 2, 128, 0, True, id="sinks-gqa4-hd128"),
    pytest.param([5, 64, 130, 511], 8, 2, 128, 65, True, id="window-and-sinks"),
    pytest.param([30, 700], 4, 4, 64, 4096, False, id="mha-window-wider-than-context"),
    pytest.param([90, 333], 32, 1, 64, 0, True, id="mqa-32-heads-one-kv"),
    pytest.param([17, 250], 12, 1, 72, 0, False, id="head-dim-with-a-vector-tail"),
    pytest.param([1, 2, 3], 2, 1, 8, 0, False, id="tiny-head-dim"),
    # head_dim of 1, 2 and 8 whole AVX-512 vectors, and a group the fixed loops take in three passes (2, 2, 1)
    pytest.param([3, 64, 100], 6, 2, 16, 0, False, id="hd16"),
    pytest.param([70, 129], 8, 1, 32, 0, True, id="hd32-gqa8-sinks"),
    pytest.param([40, 300], 10, 2, 128, 0, False, id="group-of-5-hd128"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("lens", "heads", "kvheads", "head_dim", "window", "with_sinks"), CASES)
def test_kernel_equals_the_aten_ops(kernel, lens, heads, kvheads, head_dim, window, with_sinks, dtype):
    query, key_cache, value_cache, table, seq_lens = layout(lens, heads, kvheads, head_dim, dtype)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(1)) if with_sinks else None
    args = (query, key_cache, value_cache, table, seq_lens, head_dim**-0.5, sinks, window)
    expected = oracle(*args)
    got = kv_cache.paged_decode(*args)  # through the runtime's op: the kernel serves it
    direct = kernel(*args, -1)
    assert got.dtype == dtype and got.shape == query.shape
    torch.testing.assert_close(got, direct, atol=0, rtol=0)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
        return
    # bf16/fp16: the kernel sums in fp32 where the ATen ops round scores and weights to the dtype (with sinks
    # their softmax runs in it), so both meet the oracle run in fp32, and the kernel is at least as close
    exact = oracle(query.float(), key_cache.float(), value_cache.float(), *args[3:])
    kernel_error = (got.float() - exact).abs().max().item()
    aten_error = (expected.float() - exact).abs().max().item()
    assert kernel_error <= aten_error * 1.05 + 1e-6, (kernel_error, aten_error)
    assert kernel_error <= 0.04 if dtype == torch.bfloat16 else kernel_error <= 0.008


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("lens", "heads", "kvheads", "head_dim", "window", "with_sinks"), CASES)
def test_a_float32_query_over_a_narrower_cache_equals_the_aten_ops(
    kernel, lens, heads, kvheads, head_dim, window, with_sinks, cache_dtype
):
    """--kv-cache-dtype: a float32 model's query against a bf16 or fp16 cache. The kernel widens what it
    reads and sums in fp32, as the ATen ops do after widening the cache: the same numbers, float32 out."""
    query, key_cache, value_cache, table, seq_lens = layout(lens, heads, kvheads, head_dim, torch.float32)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(1)) if with_sinks else None
    narrow = (query, key_cache.to(cache_dtype), value_cache.to(cache_dtype), table, seq_lens, head_dim**-0.5)
    args = (*narrow, sinks, window)
    got = kv_cache.paged_decode(*args)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, kernel(*args, -1), atol=0, rtol=0)  # the kernel served it
    torch.testing.assert_close(got, oracle(*args), atol=2e-5, rtol=2e-5)
    widened = (query, narrow[1].float(), narrow[2].float(), *args[3:])
    torch.testing.assert_close(got, oracle(*widened), atol=2e-5, rtol=2e-5)


def with_threads(count, fn):
    """fn() with torch's thread pool at `count` threads, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def test_a_long_context_split_across_threads_equals_one_thread_and_the_oracle(kernel):
    """One row of 4,000 tokens: with 2 threads its range is split and the splits' softmaxes merged."""
    query, key_cache, value_cache, table, seq_lens = layout([4000], 9, 3, 64, torch.float32)
    sinks = torch.randn(9)
    args = (query, key_cache, value_cache, table, seq_lens, 0.125, sinks, 0)
    single = with_threads(1, lambda: kernel(*args, -1))
    split = with_threads(2, lambda: kernel(*args, -1))
    torch.testing.assert_close(split, single, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split, oracle(*args), atol=2e-5, rtol=2e-5)
    # 32 ragged rows, some long: every row's splits land in its own output
    query, key_cache, value_cache, table, seq_lens = layout(
        [64 * i + 7 for i in range(32)], 9, 3, 64, torch.float32
    )
    args = (query, key_cache, value_cache, table, seq_lens, 0.125, None, 300)
    torch.testing.assert_close(kernel(*args, -1), oracle(*args), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_claimed_in_turn_by_the_threads_are_each_attended_once(kernel, dtype):
    """Many short ragged rows, none split: a thread claims its next row at its current row's last block (and
    asks for that row's first block there, however short the last block is), so which thread takes a row
    depends on timing; the arithmetic of a row does not. 2 threads equal 1 bit for bit, and the oracle."""
    lens = [1, 2, 15, 16, 17, 63, 64, 65, 127, 129, 191, 193] * 3
    query, key_cache, value_cache, table, seq_lens = layout(lens, 9, 3, 64, dtype, seed=4)
    args = (query, key_cache, value_cache, table, seq_lens, 0.125, None, 0)
    single = with_threads(1, lambda: kernel(*args, -1))
    runs = with_threads(2, lambda: [kernel(*args, -1) for _ in range(5)])
    for got in runs:
        torch.testing.assert_close(got, single, atol=0, rtol=0)
    exact = oracle(query.float(), key_cache.float(), value_cache.float(), *args[3:])
    tolerance = 2e-5 if dtype == torch.float32 else 0.04
    torch.testing.assert_close(single.float(), exact, atol=tolerance, rtol=tolerance)


def test_dead_rows_come_out_zero_and_live_rows_as_before(kernel):
    query, key_cache, value_cache, table, seq_lens = layout([100, 200, 1, 1], 9, 3, 64, torch.float32)
    args = (query, key_cache, value_cache, table, seq_lens, 0.125)
    full = kv_cache.paged_decode(*args)
    for live in (2, 0):
        with linear.live_rows(live):
            few = kv_cache.paged_decode(*args)
            expected = oracle(*args)
        torch.testing.assert_close(few[:live], full[:live], atol=0, rtol=0)
        assert not few[live:].any()
        torch.testing.assert_close(few, expected, atol=2e-5, rtol=2e-5)
    # a row with nothing to read (length 0) is zero too, with or without sinks
    empty = kernel(query, key_cache, value_cache, table, torch.tensor([100, 0, 1, 1]), 0.125, torch.zeros(9))
    assert not empty[1].any() and empty[0].abs().sum() > 0


def test_kernel_errors_name_the_bad_input(kernel):
    query, key_cache, value_cache, table, seq_lens = layout([100, 70], 9, 3, 64, torch.float32)
    with pytest.raises(RuntimeError, match=r"seq_lens\[1\]=900 is outside the row's block table"):
        kernel(query, key_cache, value_cache, table, torch.tensor([100, 900]), 0.125)
    # a query narrower than the cache, or two caches of different dtypes, are refused by name
    with pytest.raises(RuntimeError, match="the query must have it or be float32"):
        kernel(query.bfloat16(), key_cache, value_cache, table, seq_lens, 0.125)
    with pytest.raises(RuntimeError, match="the caches must share a dtype"):
        kernel(query, key_cache, value_cache.bfloat16(), table, seq_lens, 0.125)
    with pytest.raises(RuntimeError, match="9 query heads do not share 2 KV heads"):
        kernel(query, key_cache[:, :, :2], value_cache[:, :, :2], table, seq_lens, 0.125)
    with pytest.raises(RuntimeError, match="one logit per query head"):
        kernel(query, key_cache, value_cache, table, seq_lens, 0.125, torch.zeros(3))


def test_torch_compile_traces_the_kernel_op_without_a_graph_break(kernel):
    query, key_cache, value_cache, table, seq_lens = layout([100, 70], 9, 3, 64, torch.float32)

    def attend(q, k, v, t, n):
        return torch.ops.spyre_kernels.paged_decode(q * 1.0, k, v, t, n, 0.125) + 0

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    args = (query, key_cache, value_cache, table, seq_lens)
    torch.testing.assert_close(compiled(*args), attend(*args), atol=0, rtol=0)


def test_the_setting_turns_the_kernel_off_and_a_bad_value_is_named(monkeypatch):
    from spyre_contract.environment import ContractError

    monkeypatch.setattr(paged_attention, "_op", [])
    monkeypatch.setenv("SENDNN_INFERENCE_PAGED_ATTENTION_KERNEL", "0")
    assert paged_attention.kernel() is None
    monkeypatch.setattr(paged_attention, "_op", [])
    monkeypatch.setenv("SENDNN_INFERENCE_PAGED_ATTENTION_KERNEL", "maybe")
    with pytest.raises(ContractError, match="SENDNN_INFERENCE_PAGED_ATTENTION_KERNEL='maybe'"):
        paged_attention.kernel()


def test_a_failed_build_logs_one_line_and_the_aten_ops_serve(tmp_path):
    """No compiler (CXX names none): the build fails, one warning line says so, paged_decode still works."""
    script = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.WARNING, format='%(levelname)s %(message)s')\n"
        "from spyre_runtime.executor import kv_cache\n"
        "from spyre_runtime.executor.kernels import paged_attention\n"
        "assert paged_attention.kernel() is None\n"
        "q, k = torch.randn(1, 2, 8), torch.randn(2, 64, 1, 8)\n"
        "out = kv_cache.paged_decode(q, k, k, torch.tensor([[1]]), torch.tensor([3]), 0.3)\n"
        "assert out.shape == (1, 2, 8) and out.isfinite().all()\n"
        "print('served')\n"
    )
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    done = load_in_a_new_process(env, script)
    assert done.stdout.strip() == "served"
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, done.stderr
    assert "Paged attention kernel unavailable, the ATen ops serve" in warnings[0]
    assert "no-such-compiler: not found" in warnings[0]  # the cause, not the echoed command


def test_a_builder_killed_mid_build_blocks_nobody(tmp_path):
    """torch's build leaves a `lock` file when its process dies mid-build, and waits on such a file forever:
    under our flock a leftover one is removed and the build runs to its stamp. The build path of the
    kernel's (`_build_under`) on a one-line source, so that the test compiles in a second, not twenty."""
    directory, probe = tmp_path / "spyre_lock_probe", 'extern "C" int spyre_probe() { return 1; }'
    directory.mkdir()
    (directory / "lock").touch()
    script = (
        "import sys, pathlib\n"
        "from spyre_runtime.executor.kernels import paged_attention as pa\n"
        "directory = pathlib.Path(sys.argv[1])\n"
        "with open(directory / pa.FLOCK, 'a') as held:\n"
        "    pa._build_under(held, directory, directory.name, sys.argv[2])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(directory), probe], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert not (directory / "lock").exists() and (directory / "spyre_lock_probe.so").is_file()
    assert paged_attention._is_built(directory, "spyre_lock_probe", probe)


def test_the_shared_build_serves_the_same_source_from_another_checkout(tmp_path):
    """A second checkout of the runtime (here: its package copied beside, first on the path) loads the build
    the first one made in the shared folder and compiles nothing (ninja's build file named the source's own
    path, so each checkout rebuilt it over the other's)."""
    directory = shared_build()
    library = directory / f"{paged_attention.extension_name()}.so"
    built = library.stat().st_mtime_ns
    shutil.copytree(
        REPO / "runtime/spyre_runtime",
        tmp_path / "spyre_runtime",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"} | {"PYTHONPATH": str(tmp_path)}
    done = load_in_a_new_process(env, LOAD + "print(paged_attention.SOURCE)\n")
    assert done.stdout.strip() == str(tmp_path / "spyre_runtime/executor/kernels/paged_attention.cpp")
    assert library.stat().st_mtime_ns == built, "the kernel was built again for the same source"
    assert str(tmp_path) not in (directory / "build.ninja").read_text()


def test_a_stamped_build_loads_with_no_compiler_and_another_source_builds_again(tmp_path):
    """A finished build carries a stamp of its source: a process whose source matches loads the library as it
    is, even where ninja would rebuild (its log lacks this command line, as a build from another venv leaves
    it: the build file names the venv's torch headers) and no compiler exists (CXX names none); a stamp of
    another source is a build to make again (here: it fails, for want of the compiler, and says so)."""
    name = paged_attention.extension_name()
    directory = tmp_path / name
    shutil.copytree(shared_build(), directory)
    for leftover in ("lock", ".ninja_log", ".ninja_deps"):
        (directory / leftover).unlink(missing_ok=True)
    library = directory / f"{name}.so"
    built = library.stat().st_mtime_ns
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), CXX=str(tmp_path / "no-such-compiler"))
    logs = "import logging\nlogging.basicConfig(level=logging.WARNING)\n"
    script = logs + LOAD.replace("assert ", "print(").replace("kernel()\n", "kernel() is not None)\n")
    done = load_in_a_new_process(env, script)
    assert done.stdout.strip() == "True" and "unavailable" not in done.stderr, done.stderr
    assert library.stat().st_mtime_ns == built
    (directory / paged_attention.STAMP).write_text(paged_attention.fingerprint("// another source"))
    done = load_in_a_new_process(env, script)
    assert done.stdout.strip() == "False", done.stdout
    assert "Paged attention kernel unavailable" in done.stderr and "no-such-compiler" in done.stderr


def test_the_isa_names_are_inductors():
    """extension_name names the ISA without importing inductor (2 s of CPU): the names stay inductor's."""
    from torch._inductor import cpu_vec_isa

    for name, cls in paged_attention.ISAS.values():
        assert str(getattr(cpu_vec_isa, cls)()) == name


def test_a_prebuilt_kernel_loads_from_a_read_only_folder(tmp_path):
    """The runtime image builds the kernel into its own folder and runs with a read-only root filesystem
    (the restricted profile's): the build is loaded as it is, with no lock file and no compiler (CXX names
    none). Found on the real node, where the image's kernel went unused. A read-only bind mount (root)."""
    built, ro = tmp_path / "built", tmp_path / "ro"
    ro.mkdir()
    # the build: the host's shared one (torch's default folder; built here first if no test has yet), copied
    # as the image's build step leaves it, so this test compiles nothing of its own
    name = paged_attention.extension_name()
    shutil.copytree(shared_build(), built / name)
    (built / name / "lock").unlink(missing_ok=True)
    subprocess.run(["mount", "--bind", str(built), str(ro)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
        env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ro), CXX=str(tmp_path / "no-such-compiler"))
        done = load_in_a_new_process(env)
        assert "unavailable" not in done.stderr, done.stderr
    finally:
        subprocess.run(["umount", str(ro)], check=True)


NARROWED = (  # a server's start: a float32 model over a bfloat16 cache, then a float16 cache it left out
    "import torch\n"
    "from spyre_runtime.executor import kv_cache\n"
    "from spyre_runtime.executor.kernels import paged_attention as pa\n"
    "thread = pa.start_build(torch.float32, torch.bfloat16)\n"
    "thread and thread.join()\n"
    "op = pa.kernel()\n"
    "print(sorted(f'{c}/{q}'.replace('torch.', '') for c, q in pa._covers))\n"
    "gen = torch.Generator().manual_seed(0)\n"
    "q = torch.randn(2, 9, 64, generator=gen)\n"
    "k, v = (torch.randn(5, kv_cache.BLOCK_SIZE, 3, 64, generator=gen) for _ in 'kv')\n"
    "rest = (torch.tensor([[1, 2], [3, 4]]), torch.tensor([kv_cache.BLOCK_SIZE + 3, 9]), 0.125)\n"
    "with pa.disabled():\n"
    "    want = kv_cache.paged_decode(q, k.bfloat16(), v.bfloat16(), *rest)\n"
    "assert pa.takes(q, k.bfloat16()) and pa.takes(q.bfloat16(), k.bfloat16())\n"
    "torch.testing.assert_close(op(q, k.bfloat16(), v.bfloat16(), *rest), want, atol=2e-5, rtol=2e-5)\n"
    "assert not pa.takes(q, k.half()) and not pa.takes(q.half(), k.half())\n"
    "with pa.disabled():\n"
    "    want = kv_cache.paged_decode(q.half(), k.half(), v.half(), *rest)\n"
    "assert torch.equal(kv_cache.paged_decode(q.half(), k.half(), v.half(), *rest), want)\n"
    "try:\n"
    "    op(q.half(), k.half(), v.half(), *rest)\n"
    "except RuntimeError as e:\n"
    "    print(str(e).splitlines()[0])\n"
)


def test_a_servers_first_build_holds_its_own_dtypes_and_other_caches_take_the_aten_ops(tmp_path):
    """A server that finds no build compiles only its dtypes' paths (start_build's model and cache; 9 s
    against the whole build's 14.5 s on a 2-core Zen 5), in a folder of its own name. The build reads its
    cache under both queries, equal to the ATen ops; a float16 cache it left out goes to the ATen ops
    (`takes` says no), and the op itself refuses it naming the dtype."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    done = load_in_a_new_process(env, NARROWED)
    pairs, refusal = done.stdout.strip().splitlines()
    assert pairs == "['bfloat16/bfloat16', 'bfloat16/float32']", done.stdout
    assert refusal.startswith("paged_decode: this build reads no Half cache"), refusal
    name = f"{paged_attention.extension_name()}_kv_bfloat16_q_float32"
    assert [p.name for p in tmp_path.iterdir()] == [name]
    assert paged_attention._is_built(
        tmp_path / name,
        name,
        paged_attention.source_text(),
        ["-DSPYRE_KERNEL_CACHES=2", "-DSPYRE_KERNEL_MIXED=1"],
    )


def test_a_whole_build_serves_a_server_of_any_dtype_with_no_build_of_its_own(tmp_path):
    """Where the whole build is there (the runtime image's, the tests'), a server asking for its dtypes loads
    it as it is, with no compiler (CXX names none), and reads every cache with it."""
    name = paged_attention.extension_name()
    shutil.copytree(shared_build(), tmp_path / name)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), CXX=str(tmp_path / "no-such-compiler"))
    script = (
        "import torch\n"
        "from spyre_runtime.executor.kernels import paged_attention as pa\n"
        "thread = pa.start_build(torch.bfloat16, torch.bfloat16)\n"
        "thread and thread.join()\n"
        "assert pa.kernel() is not None\n"
        "query, cache = torch.zeros(1), torch.zeros(1, dtype=torch.half)\n"
        "print(len(pa._covers), pa.takes(query, cache))\n"
    )
    done = load_in_a_new_process(env, script)
    assert done.stdout.split() == ["5", "True"], done.stdout + done.stderr
    assert [p.name for p in tmp_path.iterdir()] == [name]
