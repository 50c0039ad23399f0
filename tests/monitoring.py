"""What the monitoring tests share (issue 41): Debian's promtool and prometheus (taken out of the package
once, by tests/cluster/build-prometheus.sh), and the metric names the runtime and the operator really
export, to hold every PromQL expression we ship to them."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from spyre_operator.io.metrics import OperatorMetrics
from spyre_runtime.entrypoints.server.metrics import Metrics

from tests.conftest import REPO

# a name of ours in an expression: vLLM's and sendnn's (with their colon), our spyre_* ones
OUR_METRIC = re.compile(r"(?<![\w:])((?:vllm|sendnn):[a-z0-9_:]+|spyre_[a-z0-9_]+)")
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}


def prometheus_bin(name: str) -> Path:
    """promtool or prometheus, fetched from Debian's package on first use."""
    cache = os.environ.get("SPYRE_K8S_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "spyre-serve"
    )
    path = Path(cache) / "prometheus" / "bin" / name
    if not path.exists():
        subprocess.run(["bash", str(REPO / "tests/cluster/build-prometheus.sh")], check=True)
    return path


def exported_metric_names() -> set[str]:
    """Every sample name the runtime (a generating server, so vLLM's and sendnn's too) and the operator
    expose, with the suffixes of counters and histograms."""
    names: set[str] = set()
    for registry in (Metrics("m").registry, OperatorMetrics().registry):
        for family in registry.collect():
            suffixes = SUFFIXES.get(family.type, ("",))
            names |= {family.name + s for s in suffixes}
    return names


def metric_names_in(expr: str) -> set[str]:
    """Our metric names an expression reads (label values inside {...} left out)."""
    return set(OUR_METRIC.findall(re.sub(r'"[^"]*"', '""', expr)))
