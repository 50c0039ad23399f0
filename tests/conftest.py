"""Shared fixtures. The `cluster` fixture is one real control plane for the whole session."""

from __future__ import annotations

import os

# Every test process and every server it starts: OpenMP threads that sleep when they wait instead of spinning.
# pytest-xdist runs two workers, each with servers of two torch threads, on two cores; spinning threads then
# take the cores from the ones with work (measured: two servers' beam searches side by side took 51-59 s with
# spinning threads, 14-15 s with sleeping ones). libgomp reads it when torch loads, after this line.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cluster.controlplane import ControlPlane, default_bin_dir, spyre_nodes

REPO = Path(__file__).resolve().parent.parent

# The slowest modules first (seconds of work in a loaded two-worker run, 2026-11-26; `make test` passes
# --no-loadscope-reorder so pytest-xdist keeps this order): a worker takes the next module when it finishes
# one, so a long module handed out last would run alone at the end of the suite. The rest keep their order.
SLOW_FIRST = (
    "tests/test_real_node.py",  # 302 s
    "tests/test_bench_smoke.py",  # 467 s
    "tests/test_e2e.py",  # 330 s
    "tests/runtime/executor/test_graph_cache.py",  # 161 s
    "tests/operator/test_model_sources.py",  # 147 s
    "tests/runtime/entrypoints/test_tool_calls_smollm2.py",  # 132 s
    "tests/operator/test_fleet.py",  # 122 s
    "tests/operator/test_unkind.py",  # 111 s
    "tests/runtime/test_beam_search_smollm2.py",  # 104 s
    "tests/runtime/executor/families/test_families.py",  # 102 s
)


def pytest_collection_modifyitems(config, items):
    rank = {module: i for i, module in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def wait_for(predicate: Callable[[], object], timeout: float = 30.0, what: str = "condition", step=0.2):
    """Polls `predicate` until it returns a truthy value, which is returned; fails naming `what`."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as e:  # the object may not exist yet
            last_error = e
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last error: {last_error})")


def ensure_k8s_binaries() -> Path:
    bin_dir = default_bin_dir()
    if not (bin_dir / "kube-apiserver").exists():
        subprocess.run(["bash", str(REPO / "tests/cluster/build-k8s.sh")], check=True)
    return bin_dir


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> ControlPlane:
    ensure_k8s_binaries()
    cp = ControlPlane(workdir=tmp_path_factory.mktemp("cluster"))
    cp.start()
    try:
        cp.register_nodes(spyre_nodes(count=2, cards=8))
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="session")
def kubeconfig(cluster) -> Path:
    return cluster.kubeconfig


@pytest.fixture(scope="session")
def kube(cluster):
    """A kubernetes ApiClient authenticated as the cluster admin."""
    return cluster.api_client()


def kubectl(cluster: ControlPlane, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return cluster.kubectl(*args, check=check, timeout=60)


@pytest.fixture(scope="session")
def crd(cluster):
    kubectl(cluster, "apply", "--validate=false", "-f", str(REPO / "crds/spyremodels.yaml"))
    kubectl(cluster, "wait", "--for=condition=established", "--timeout=60s", "crd/spyremodels.spyre-serve.io")
    return "spyremodels.spyre-serve.io"
