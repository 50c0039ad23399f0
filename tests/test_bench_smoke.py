"""Every script in bench/ run through its command line at its smallest size (but step_mix_bench.py and
variants_ab.py, which serve SmolLM2 in the matrix's configuration for minutes): a tiny seeded model (MiniLM
for the pooling bench), the eager backend where compiling is not what is measured (vLLM's too: --vllm-eager),
one request (two where a figure needs a second), the JSON written to a temporary file (never over
bench/results-*.json). Each must finish and report figures that are there and non-zero, so a bench cannot
stop measuring unnoticed (issue 37: operator_scale.py ran to its 600 s limit with no pod for a round).
vLLM, the peer, is served by matrix_bench (vllm_bench runs our side only: its vLLM parts are the matrix's);
it is left out where its environment is not built, and the matrix still runs, with our side only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from spyre_runtime.testing.models import write_tiny_model

from tests.conftest import REPO, ensure_k8s_binaries

VLLM_READY = (
    Path(os.environ.get("SPYRE_VLLM_VENV", Path.home() / ".cache/spyre-serve/vllm-venv")) / ".vllm-ready"
)
PEER = ["ours,vllm"] if VLLM_READY.is_file() else ["ours"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("bench-model") / "tiny")


@pytest.fixture(scope="module")
def tiny_peer(tmp_path_factory) -> Path:
    """The tiny model with a head size vLLM's CPU attention serves (32; the default tiny's 16 starts, then
    kills vLLM's engine at the first request: "Unsupported CPU attention configuration: head_dim=16")."""
    return write_tiny_model(tmp_path_factory.mktemp("bench-peer-model") / "tiny", hidden=128, heads=4)


def run_script(script: str, *args: str, cwd: Path | None = None, timeout: float = 600):
    """Runs bench/<script> with `args`; its completed process (output captured as text)."""
    return subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def bench(script: str, tmp_path: Path, *args: str, timeout: float = 600) -> dict:
    """Runs bench/<script> with `args` and --out in tmp_path; returns the JSON it wrote."""
    out = tmp_path / f"{script}.json"
    run = run_script(script, *args, "--out", str(out), cwd=tmp_path, timeout=timeout)
    assert run.returncode == 0, (
        f"{script} exited with {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    )
    assert out.is_file(), f"{script} wrote no results:\n{run.stdout[-2000:]}"
    return json.loads(out.read_text())


def positive(*values) -> bool:
    """Every figure is a positive number (a dict: each path's figure, e.g. profile_step's aten and kernel)."""
    flat = [x for v in values for x in (v.values() if isinstance(v, dict) else [v])]
    return bool(flat) and all(isinstance(v, int | float) and v > 0 for v in flat)


def served(summary: dict, requests: int) -> None:
    """A load summary of `requests` streamed requests that really produced tokens."""
    assert summary["requests"] == requests and summary["output_tokens"] >= requests, summary
    assert positive(summary["tok_per_s"], summary["wall_s"], summary["ttft_p50"]), summary


def test_serve_bench(tiny, tmp_path):
    res = bench(
        "serve_bench.py",
        tmp_path,
        *("--model", str(tiny), "--backend", "eager", "--requests", "1", "--concurrency", "1"),
        *("--hf-requests", "1", "--logs", str(tmp_path / "logs")),
    )
    served(res["spyre_serve"], 1)
    assert "Uvicorn running" in (tmp_path / "logs/spyre_serve.log").read_text()  # its server's log, kept
    assert positive(res["spyre_serve"]["ready_s"], res["hf_one_at_a_time"]["tok_per_s"])
    assert positive(res["hf_static_batches_of_8"]["tok_per_s"], res["spyre_serve_vs_hf_one_at_a_time"])
    step = res["step_overhead"]
    assert positive(step["engine_decode_step_ms"], step["compiled_forward_ms"]), step


def test_cb_bench(tiny, tmp_path):
    res = bench(
        "cb_bench.py",
        tmp_path,
        *("--model", str(tiny), "--backend", "eager", "--requests", "1", "--rate", "100"),
        *("--prefix-requests", "2"),  # the first is cold: one measured
        *("--logs", str(tmp_path / "logs")),
    )
    # each server's log kept where asked, none at a fixed name shared by concurrent runs
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "cb-no-prefix.log",
        "cb.log",
        "static.log",
    ]
    served(res["static"], 1)
    served(res["continuous"], 1)
    for side in ("prefix_caching_on", "prefix_caching_off"):
        assert res[side]["requests"] == 1 and positive(res[side]["ttft_median_s"]), res[side]
    assert positive(res["cb_vs_static_throughput"], res["prefix_ttft_speedup"])


def test_cache_bench_compiles_once_then_loads(tiny, tmp_path):
    """The one bench whose subject is compiling: inductor, one shape."""
    res = bench("cache_bench.py", tmp_path, "--model", str(tiny), "--shapes", "1", timeout=900)
    assert res["cold"]["cache"] == "miss" and res["cold"]["graphs_compiled"] > 0, res["cold"]
    assert res["warm"]["cache"] == "hit" and res["warm"]["graphs_compiled"] == 0, res["warm"]
    assert positive(res["entry_bytes"], res["cold"]["warmup_seconds"], res["warmup_speedup"])


def test_profile_step(tiny, tmp_path):
    res = bench(
        "profile_step.py",
        tmp_path,
        *("--model", str(tiny), "--backend", "eager", "--batch", "1", "--kv", "64", "--chunk", "64"),
        *("--iters", "2"),
    )
    assert positive(res["decode_forward_ms"], res["chunk_forward_ms"], res["decode_inputs_ms"]), res
    assert set(res["decode_forward_ms"]) == {"aten", "kernel"}  # both attention paths were measured
    for path, top in res["decode_top_ops"].items():  # each path's profile names the ops that took time
        assert top["ops"] and positive(top["ops"][0]["self_ms_per_step"], top["profiled_step_ms"]), path
    assert (tmp_path / "profile_step.py.png").stat().st_size > 5000  # the chart beside the JSON


def test_floor_bench(tiny, tmp_path):
    res = bench(
        "floor_bench.py",
        tmp_path,
        *("--model", str(tiny), "--backend", "eager", "--kv", "64", "--iters", "2", "--probe-gib", "0.0625"),
    )
    assert positive(res["weights_mb"], res["forward_ms"], res["step_ms"]), res
    for prefix in ("", "huge_"):  # both probes: the weights' pages and 2 MiB pages
        assert positive(res[f"{prefix}read_gb_per_s"], res[f"{prefix}floor_ms"]), res
        assert positive(res[f"forward_over_{prefix}floor"], res[f"step_over_{prefix}floor"]), res


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_row_linear_bench(tmp_path, dtype):
    """SmolLM2's 121 weights by the row linear and by oneDNN (the bench checks they agree) at 1 and 15 rows
    (a 14-row pass and a 1-row one on AVX-512)."""
    res = bench(
        "row_linear_bench.py", tmp_path, "--rows", "1,15", "--iters", "1", "--flush-mb", "1", "--dtype", dtype
    )
    for rows in ("rows_1", "rows_15"):
        assert positive(res[rows]["ours_ms"], res[rows]["onednn_ms"], res[rows]["ratio"]), res


def test_glu_bench(tmp_path):
    res = bench("glu_bench.py", tmp_path, "--rows", "1,40", "--iters", "1", "--flush-mb", "1")
    for rows in ("rows_1", "rows_40"):  # the row linear's GLU, and oneDNN's GEMM then the GLU in one pass
        assert positive(res[rows]["packed_glu_ms"], res[rows]["before_ms"]), res


def test_paged_attention_bench(tmp_path):
    """Every case: the kernel against the ATen ops it replaces, and their largest difference."""
    res = bench("paged_attention_bench.py", tmp_path, "--iters", "1", "--dtype", "bfloat16")
    assert len(res["cases"]) == 7, res
    for case in res["cases"]:
        assert positive(case["aten_ms"], case["kernel_ms"]) and case["max_abs_diff"] < 0.05, case


def test_waves_sim_prints_one_row_per_budget():
    run = run_script("waves_sim.py", "--budgets", "0,150", "--requests", "8", timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert lines[0].startswith("| budget_ms | output_tok_s |") and len(lines) == 4, run.stdout
    assert [line.split("|")[1].strip() for line in lines[2:]] == ["0", "150"], run.stdout


def test_ceiling_bench_prices_every_cell_of_a_matrix(tmp_path):
    matrix = str(REPO / "bench/results-matrix-zen4-r57.json")
    res = bench("ceiling_bench.py", tmp_path, matrix, "--gemm-size", "256")
    for dtype in ("float32", "bfloat16"):
        cells = {k: v for k, v in res[dtype].items() if k != "gemm_gflops"}
        assert set(cells) == {"c8", "c32", "vllm_client_c8", "vllm_client_c32"}, res[dtype]
        for cell in cells.values():
            assert positive(cell["tflop"], cell["ours_gflops"], cell["vllm_gflops"]), cell
            assert cell["needed_of_gemm"] == pytest.approx(1.2 * cell["vllm_of_gemm"], abs=2e-3), cell
    # both systems served the same work: the cell's FLOPs are one figure (here, run 57's 128 requests at 32)
    assert res["float32"]["c32"]["tflop"] == res["bfloat16"]["c32"]["tflop"] == 6.34


def test_ceiling_bench_refuses_a_run_whose_workload_it_cannot_rebuild(tmp_path):
    matrix = json.loads((REPO / "bench/results-matrix-zen4-r57.json").read_text())
    matrix["float32"]["ours"]["c8"]["output_tokens"] += 1  # not serve_bench's seeded workload any more
    (tmp_path / "m.json").write_text(json.dumps(matrix))
    run = run_script("ceiling_bench.py", str(tmp_path / "m.json"), "--gemm-size", "64", timeout=120)
    assert run.returncode == 1
    assert run.stderr.strip() == "c8: the seeded workload has 2439 output tokens, the run had 2440"


def test_ceiling_bench_refuses_a_matrix_without_the_peer(tmp_path):
    matrix = json.loads((REPO / "bench/results-matrix-zen4-r57.json").read_text())
    for dtype in ("float32", "bfloat16"):
        del matrix[dtype]["vllm"]  # as `matrix_bench.py --systems ours` writes it
    (tmp_path / "ours.json").write_text(json.dumps(matrix))
    run = run_script("ceiling_bench.py", str(tmp_path / "ours.json"), timeout=120)
    assert run.returncode == 1 and "no dtype with both systems' cells to price" in run.stderr, run.stderr


def test_tracing_bench(tmp_path):
    res = bench("tracing_bench.py", tmp_path, "--spans", "50", "--runs", "1")
    assert res["startup_off"] == {**res["startup_off"], "tracer": False, "otel_sdk_modules": 0}
    assert res["startup_on"]["tracer"] and res["startup_on"]["otel_sdk_modules"] > 0
    assert positive(res["record_us_per_span"], res["exported_bytes"])  # the spans reached the receiver


def test_bf16_bench(tmp_path):
    res = bench("bf16_bench.py", tmp_path, "--rows", "1", "--iters", "1", "--kv", "64")
    arms, kernels = res["rows"]["1"], res["onednn"]["kernels"]
    assert positive(arms["gemm fp32 packed"], arms["gemm bf16 plain"], arms["attention bf16"]), arms
    assert positive(arms["gemm bf16 / fp32"]), arms
    # oneDNN named the kernel of every GEMM path it ran (the packed ones are always oneDNN's); where it
    # cannot pack bf16 (AVX2), the bench says so and runs the plain bf16 GEMM the runtime runs there
    assert len(kernels) == 12 and "not oneDNN" not in kernels["packed torch.float32 8"], kernels
    if res["bf16_packs"]:
        assert positive(arms["gemm bf16 packed"]) and "not oneDNN" not in kernels["packed torch.bfloat16 8"]
    else:
        assert "gemm bf16 packed" not in arms, arms
        assert kernels["packed torch.bfloat16 8"].startswith("unsupported"), kernels


def test_tp_bench(tmp_path):
    res = bench("tp_bench.py", tmp_path, "--models", "tiny", "--backend", "eager")
    row = res["tiny (hidden 64, 2 layers)"]
    for tp in ("n1", "n2"):
        assert positive(row[tp]["decode_step_ms_median"], row[tp]["output_tok_per_s"]), row[tp]
    assert positive(row["n2"]["send_step_ms_median"], row["step_ratio_n2_over_n1"])  # rank 2 was sent steps


def test_pooling_bench(tmp_path):
    res = bench("pooling_bench.py", tmp_path, "--rounds", "1", "--backends", "eager")
    assert res["max_abs_diff_vs_sentence_transformers"] < 1e-4
    assert positive(*res["in_process_embeddings_per_second"].values())
    assert len(res["served_embeddings_per_second"]) == 3
    assert positive(*res["served_embeddings_per_second"].values(), res["server_startup_seconds"])


def test_vllm_bench(tiny_peer, tmp_path):
    """Our side only: this script's vLLM parts (its environment, command line and server) are the ones
    test_matrix_bench runs against vLLM, and its phases are the same code for each system. Its ratios and
    table are checked on our own figures twice over (each ratio then 1)."""
    from bench import vllm_bench

    res = bench(
        "vllm_bench.py",
        tmp_path,
        *("--model", str(tiny_peer), "--backend", "eager", "--requests", "1", "--single-requests", "1"),
        *("--skip-cold", "--systems", "ours"),
    )
    served(res["ours"]["c8"], 1)
    served(res["ours"]["c1"], 1)
    assert positive(res["ours"]["ready_warm_s"], res["ours"]["c1"]["tpot_p50"])
    ratios = vllm_bench.ratios(res["ours"], res["ours"])
    assert len(ratios) == 8 and all(r == pytest.approx(1.0) for r in ratios.values()), ratios
    table = vllm_bench.markdown({"ours": res["ours"], "vllm": res["ours"], "ours_over_vllm": ratios})
    assert table.count("1.00×") == 8 and "| – |" in table, table  # ITL p50 and a cold start: none


CLIENT = ("--client-prompts", "2", "--client-streams", "8")  # vLLM's client: 2 prompts at 8 streams


@pytest.mark.parametrize("systems", PEER)
def test_matrix_bench(tiny_peer, tmp_path, systems):
    res = bench(
        "matrix_bench.py",
        tmp_path,
        *("--model", str(tiny_peer), "--backend", "eager", "--dtypes", "float32", "--streams", "1,2"),
        *("--single-requests", "1", "--requests-per-stream", "1", "--max-model-len", "384"),
        *("--chunk", "256", "--bandwidth-gib", "0.0625", "--vllm-eager", "--systems", systems),
        *(CLIENT if "vllm" in systems else ("--no-vllm-client",)),
        timeout=900,
    )
    assert positive(res["machine"]["read_gb_per_s"])
    for name in systems.split(","):
        served(res["float32"][name]["c1"], 1)
        served(res["float32"][name]["c2"], 2)
        assert positive(res["float32"][name]["ready_s"])
        if "vllm" in systems:  # vLLM's client against each system
            client = res["float32"][name]["vllm_client_c8"]
            assert client["completed"] == 2, client
            assert positive(client["output_throughput"], client["p99_itl_ms"]), client
    assert (tmp_path / "matrix_bench.py.png").stat().st_size > 5000  # the chart beside the JSON


@pytest.mark.cluster
def test_operator_scale(tmp_path):
    """One model on a fresh control plane: created, its pod made, Ready, the operator's requests counted."""
    ensure_k8s_binaries()
    res = bench("operator_scale.py", tmp_path, "--models", "1", "--resync", "1", "--timeout", "120")
    assert res["ready_models"] == 1 and res["pods"] == 1, res
    assert not [k for k in res if k.startswith("not_converged")], res
    assert positive(res["operator_requests_per_model"], res["operator_peak_rss_mb"], res["converge_seconds"])
    assert res["operator_requests_by_kind"].get("create pods", 0) >= 1  # the pod (and its dry runs)
    # one: the pod watch's own at start-up; the pod step acts on the watch's view
    assert res["operator_requests_by_kind"].get("list pods", 0) <= 1, res


def test_kernel_ab(tmp_path):
    """The kernel's source against itself: both builds run every case, and their outputs are identical."""
    res = bench(
        "kernel_ab.py",
        tmp_path,
        str(REPO / "runtime/spyre_runtime/executor/kernels/paged_attention.cpp"),
        *("--iters", "1", "--cases", "2"),
    )
    assert [row["case"] for row in res["cases"]] == ["1 x 384 float32", "8 x 384 float32"], res
    for row in res["cases"]:
        assert positive(row["before_ms"], row["after_ms"]) and row["max_abs_diff"] == 0.0, row


def test_a_server_keeps_vllm_sockets_in_a_folder_of_its_own(tmp_path):
    """vLLM's processes create their ZeroMQ sockets as files named by UUIDs in VLLM_RPC_BASE_PATH (default:
    the temp folder) and leave them there: every bench server (vllm_bench.Server) is given a folder of its own
    for them, which goes, with what its process group left in it, when the server stops."""
    from bench.vllm_bench import Server

    script = (
        "import os, pathlib, time; "
        "pathlib.Path(os.environ['VLLM_RPC_BASE_PATH'], 'a0c1-socket').write_text('left behind'); "
        "time.sleep(120)"
    )
    server = Server("rpc-probe", [sys.executable, "-c", script], {}, tmp_path)
    left = server.rpc_dir / "a0c1-socket"
    try:
        assert server.rpc_dir.parent == Path(tempfile.gettempdir())
        deadline = time.monotonic() + 60
        while not left.is_file() and server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert left.is_file(), f"the process did not write into its own folder:\n{server.tail()}"
    finally:
        server.stop()
    assert server.proc.returncode is not None
    assert not server.rpc_dir.exists()
