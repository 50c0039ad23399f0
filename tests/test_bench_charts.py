"""The bench's charts (bench/charts.py): a serving matrix's tok/s and ITL p99 against streams, ours and
vLLM's, and a step profile's top ops, rendered from small results files into PNGs beside them; a results
file of another shape is skipped, not drawn empty."""

from __future__ import annotations

import json
import struct

import pytest

from bench import charts


def summary(tok_per_s: float, itl_p99: float) -> dict:
    return {"requests": 4, "tok_per_s": tok_per_s, "itl_p99": itl_p99, "ttft_p50": 0.2}


MATRIX = {
    "machine": {"cpu": "test"},
    "float32": {
        "ours": {"ready_s": 3.0, "c1": summary(20, 0.06), "c8": summary(90, 0.3), "c32": summary(150, 0.5)},
        "vllm": {"ready_s": 9.0, "c1": summary(22, 0.05), "c8": summary(100, 0.25)},
    },
}


def png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


def test_the_matrix_chart_draws_both_systems_against_streams(tmp_path):
    fig = charts.figure_for(MATRIX, "matrix")
    tok, itl = fig.axes
    lines = {line.get_label(): line for line in tok.get_lines()}
    assert set(lines) == {"spyre-serve", "vLLM"}
    assert list(lines["spyre-serve"].get_xdata()) == [1, 8, 32]
    assert list(lines["spyre-serve"].get_ydata()) == [20, 90, 150]
    assert list(lines["vLLM"].get_xdata()) == [1, 8] and list(lines["vLLM"].get_ydata()) == [22, 100]
    itl_lines = {line.get_label(): list(line.get_ydata()) for line in itl.get_lines()}
    assert itl_lines["vLLM"] == pytest.approx([50, 250])  # milliseconds
    path = tmp_path / "results-matrix.json"
    path.write_text(json.dumps(MATRIX))
    out = charts.write_chart(path)
    assert out == tmp_path / "results-matrix.png"
    width, height = png_size(out)
    assert width >= 600 and height >= 200
    assert 5_000 < out.stat().st_size < 200_000
    into = tmp_path / "images"
    into.mkdir()
    assert charts.main(["--into", str(into), str(path)]) == 0
    assert png_size(into / "results-matrix.png") == (width, height)


def test_ours_alone_is_one_series_and_an_unknown_file_is_skipped(tmp_path):
    fig = charts.figure_for({"ours": {"c1": summary(20, 0.06), "c4": summary(60, 0.2)}}, "ours only")
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["spyre-serve"]
    other = tmp_path / "results-operator.json"
    other.write_text(json.dumps({"models": 10, "seconds": 3}))
    assert charts.write_chart(other) is None and not other.with_suffix(".png").exists()
    assert charts.main([str(other)]) == 0


def test_the_profile_chart_has_a_bar_per_path_and_op(tmp_path):
    ops = [
        {"op": "mkldnn::_linear_pointwise", "self_ms_per_step": 30.0},
        {"op": "aten::mm", "self_ms_per_step": 5},
    ]
    step = {"aten": {"ops": ops}, "kernel": {"ops": ops[:1]}}
    fig = charts.figure_for({"decode_top_ops": step, "chunk_top_ops": step}, "profile")
    decode = fig.axes[0]
    widths = sorted(bar.get_width() for bar in decode.patches)
    assert widths == [0.0, 5.0, 30.0, 30.0]  # two ops for ATen, one for the kernel (the other at 0)
    assert [label.get_text() for label in decode.get_yticklabels()] == [
        "mkldnn::_linear_pointwise",
        "aten::mm",
    ]
    path = tmp_path / "results-profile.json"
    path.write_text(json.dumps({"decode_top_ops": step, "chunk_top_ops": step}))
    assert png_size(charts.write_chart(path))[0] >= 600
