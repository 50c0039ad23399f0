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

# The slowest modules first (seconds of work in a loaded three-process run, 2026-11-27; `make test` passes
# --no-loadscope-reorder so pytest-xdist keeps this order): a process takes the next group when it finishes
# one, so a long group handed out last would run alone at the end of the suite. The rest keep their order.
CONTROL_PLANE_GROUP = "control-plane"
SLOW_FIRST = (
    "tests/test_real_node.py",  # 521 s
    CONTROL_PLANE_GROUP,  # 632 s: the modules of the session control plane, below
    "tests/test_bench_smoke.py",  # 415 s
    "tests/test_e2e.py",  # 196 s
    "tests/operator/test_model_sources.py",  # 189 s
    "tests/runtime/executor/test_graph_cache.py",  # 154 s
    "tests/runtime/test_beam_search_smollm2.py",  # 138 s
    "tests/runtime/executor/test_hot_path.py",  # 146 s
    "tests/runtime/executor/families/test_pooling.py",  # 137 s
    "tests/runtime/executor/families/test_vision.py",  # 126 s
)
# The modules that use the session control plane (the `cluster` fixture, which a test's fixture closure holds
# whenever it uses one made on it: `kube`, `crd`, `operator`...). `make test`
# hands each module to one test process (pytest-xdist, --dist loadfile), so that its shared server or stack is
# made once, and these modules together to one process, so that one process starts one control plane: each
# idles at about 2.2 CPU-s a minute for the whole run and takes 6 CPU-s to start, and three processes each
# made their own. Collection fails naming a module that uses the plane and is not listed.
CONTROL_PLANE_MODULES = frozenset(
    (
        "tests/operator/io/test_spyre_stack.py",
        "tests/operator/kinds/test_pod_monitor.py",
        "tests/operator/kinds/test_precompile.py",
        "tests/operator/test_access.py",
        "tests/operator/test_api.py",
        "tests/operator/test_autoscale.py",
        "tests/operator/test_fleet.py",
        "tests/operator/test_reconcile.py",
        "tests/operator/test_unkind.py",
        "tests/runtime/sources/test_fetch_model.py",
        "tests/test_chart.py",
        "tests/test_chart_monitoring.py",
        "tests/test_controlplane.py",
        "tests/test_crd_server.py",
    )
)


def work_unit(nodeid: str) -> str:
    """What one test process is handed at a time: a module, or the control plane's modules together."""
    module = nodeid.split("::", 1)[0]
    return CONTROL_PLANE_GROUP if module in CONTROL_PLANE_MODULES else module


def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile by `work_unit` instead of by file (pytest-xdist's own loadgroup marks do not reach
    pytest 9's node ids)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class WorkUnits(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return WorkUnits(config, log)


def pytest_collection_modifyitems(config, items):
    unlisted = sorted(
        {item.nodeid.split("::", 1)[0] for item in items if "cluster" in getattr(item, "fixturenames", ())}
        - CONTROL_PLANE_MODULES
    )
    if unlisted:
        raise pytest.UsageError(
            f"{', '.join(unlisted)} use the session control plane: add them to CONTROL_PLANE_MODULES in "
            "tests/conftest.py (they run in the process that has it)"
        )
    rank = {unit: i for i, unit in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(work_unit(item.nodeid), len(rank)))


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
