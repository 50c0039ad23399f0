"""The bench's results as pictures, beside their JSON (results-x.json -> results-x.png):

- a serving matrix (matrix_bench.py, vllm_bench.py: `ours`/`vllm` with `c<streams>` summaries, per dtype or
  not): output tok/s and ITL p99 against concurrent streams, ours and vLLM's when the run has them;
- a step profile (profile_step.py): the decode and chunk steps' top ops, ms per step, per path (ATen ops,
  kernel) when the run compared them.

    .venv/bin/python -m bench.charts bench/results-*.json     # or: python bench/charts.py FILE...
    .venv/bin/python -m bench.charts --into docs/images bench/results-matrix-xeon.json   # the docs' pictures

Files of another shape are skipped with a line. matplotlib is imported here only (the `bench` extra)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

SYSTEMS = {"ours": ("spyre-serve", "tab:blue", "o"), "vllm": ("vLLM", "tab:orange", "s")}
STREAMS = re.compile(r"^c(\d+)$")
TOP_OPS = 8


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def matrix_groups(results: dict) -> dict[str, dict]:
    """{label: {system: summaries}}: one group per dtype (matrix_bench), or the whole run (vllm_bench)."""
    if "ours" in results:
        return {"": results}
    return {k: v for k, v in results.items() if isinstance(v, dict) and "ours" in v}


def series(summaries: dict, figure: str) -> tuple[list[int], list[float]]:
    """(streams, values) of one system's `c<N>` summaries, by streams."""
    points = sorted(
        (int(m.group(1)), s[figure])
        for key, s in summaries.items()
        if (m := STREAMS.match(key)) and isinstance(s, dict) and figure in s
    )
    return [p[0] for p in points], [p[1] for p in points]


def matrix_figure(results: dict, title: str):
    """tok/s and ITL p99 (ms) against streams: one row per group, one line per system."""
    plt = _pyplot()
    groups = matrix_groups(results)
    fig, axes = plt.subplots(len(groups), 2, figsize=(9, 3.2 * len(groups)), squeeze=False)
    for row, (label, systems) in zip(axes, groups.items(), strict=True):
        for ax, figure, name, scale in (
            (row[0], "tok_per_s", "output tok/s", 1.0),
            (row[1], "itl_p99", "ITL p99 (ms)", 1000.0),
        ):
            ticks = set()
            for system, (legend, color, marker) in SYSTEMS.items():
                xs, ys = series(systems.get(system) or {}, figure)
                if xs:
                    ax.plot(xs, [y * scale for y in ys], marker=marker, color=color, label=legend)
                    ticks.update(xs)
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
            ax.set_xlabel("concurrent streams")
            ax.set_ylabel(name)
            ax.set_title(f"{name}{f', {label}' if label else ''}")
            ax.grid(True, alpha=0.3)
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def is_profile(results: dict) -> bool:
    return "decode_top_ops" in results and "chunk_top_ops" in results


def profile_paths(top_ops) -> dict[str, list[dict]]:
    """{path: ops}: one path ("") in a plain profile, ATen's and the kernel's when the run compared them."""
    if isinstance(top_ops, list):
        return {"": top_ops}
    return {path: p["ops"] for path, p in top_ops.items()}


def short(op: str) -> str:
    return "compiled graph" if op.startswith("## Call CompiledFxGraph") else op[:40]


def profile_figure(results: dict, title: str):
    """The decode and the chunk step's top ops, ms per step, a bar per path."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, step in zip(axes, ("decode", "chunk"), strict=True):
        paths = profile_paths(results[f"{step}_top_ops"])
        names = []
        for ops in paths.values():
            names += [short(o["op"]) for o in ops[:TOP_OPS] if short(o["op"]) not in names]
        names = names[:TOP_OPS]
        height = 0.8 / len(paths)
        for i, (path, ops) in enumerate(paths.items()):
            ms = {}
            for o in ops:
                ms[short(o["op"])] = ms.get(short(o["op"]), 0.0) + o["self_ms_per_step"]
            ys = [j + i * height for j in range(len(names))]
            ax.barh(ys, [ms.get(n, 0.0) for n in names], height=height, label=path or None)
        ax.set_yticks([j + 0.4 - height / 2 for j in range(len(names))], names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("self ms per step")
        ax.set_title(f"{step} step, top ops")
        if len(paths) > 1:
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def figure_for(results: dict, title: str):
    """The chart of a results file, or None when its shape is not one charted here."""
    if is_profile(results):
        return profile_figure(results, title)
    if any(series(systems.get("ours") or {}, "tok_per_s")[0] for systems in matrix_groups(results).values()):
        return matrix_figure(results, title)
    return None


def write_chart(path: Path, into: Path | None = None) -> Path | None:
    """results-x.json -> results-x.png beside it (or in `into`); None when the file is not charted."""
    results = json.loads(path.read_text())
    fig = figure_for(results, path.stem) if isinstance(results, dict) else None
    if fig is None:
        return None
    out = (into / path.name if into else path).with_suffix(".png")
    fig.savefig(out, dpi=80)
    _pyplot().close(fig)
    return out


def chart_beside(path: Path) -> None:
    """What a bench calls after writing its JSON: the chart beside it, or a line saying why not."""
    try:
        out = write_chart(path)
    except ImportError as e:
        print(f"no chart ({e}): pip install matplotlib (the bench extra)", flush=True)
        return
    print(f"chart: {out}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.charts", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="bench/results-*.json")
    ap.add_argument("--into", type=Path, default=None, help="write the PNGs here (default: beside the JSON)")
    args = ap.parse_args(argv)
    for path in args.results:
        out = write_chart(path, args.into)
        print(f"{path} -> {out}" if out else f"{path}: not a matrix or a profile, skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
