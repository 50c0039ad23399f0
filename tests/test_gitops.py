"""GitOps health: Argo CD's health check (health.lua in Argo CD's own layout, run with a real Lua) and
kstatus (Flux, kubectl wait) read every state of a SpyreModel the same way."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from lupa import LuaRuntime

from tests.conftest import REPO
from tests.operator.objects import kstatus, pod, status_of
from tests.test_chart import by_kind, render

CHECK = REPO / "charts/spyre-operator/files/argocd/spyre-serve.io/SpyreModel"


def argo_health(obj: dict) -> dict:
    """Runs health.lua as Argo CD does: the object as the global `obj`, a table {status, message} back."""
    lua = LuaRuntime(unpack_returned_tuples=True)

    def to_lua(value):
        if isinstance(value, dict):
            return lua.table_from({k: to_lua(v) for k, v in value.items()})
        if isinstance(value, list):
            return lua.table_from([to_lua(v) for v in value])
        return value

    lua.globals().obj = to_lua(obj)
    result = lua.execute((CHECK / "health.lua").read_text())
    return {"status": result["status"], "message": result["message"]}


def _cases():
    tests = yaml.safe_load((CHECK / "health_test.yaml").read_text())["tests"]
    return [pytest.param(t, id=Path(t["inputPath"]).stem) for t in tests]


@pytest.mark.parametrize("case", _cases())
def test_argocd_health_test_yaml(case):
    obj = yaml.safe_load((CHECK / case["inputPath"]).read_text())
    assert argo_health(obj) == case["healthStatus"]


def test_testdata_covers_terminating_stale_and_suspended():
    names = {Path(t.values[0]["inputPath"]).stem for t in _cases()}
    assert {"terminating", "stale-generation", "suspended", "healthy", "invalid"} <= names


@pytest.mark.parametrize(
    ("state", "pods", "kw", "argo", "kstat"),
    [
        ("ready", [pod("a")], {}, "Healthy", "Current"),
        ("warming", [pod("a", ready=False)], {}, "Progressing", "InProgress"),
        ("invalid", [], {"invalid": "spec.cards: must be one of 1, 2, 4, 8"}, "Degraded", "Failed"),
        (
            "crash-loop",
            [pod("a", ready=False, waiting="CrashLoopBackOff", last_message="x")],
            {},
            "Degraded",
            "Failed",
        ),
    ],
)
def test_argocd_and_kstatus_agree_on_operator_status(state, pods, kw, argo, kstat):
    obj = {"metadata": {"name": "m", "generation": 2}, "spec": {}, "status": status_of(pods, **kw)}
    assert argo_health(obj)["status"] == argo, state
    assert kstatus(obj) == kstat, state


def test_chart_renders_the_health_check_for_argocd_cm():
    assert not [d for d in by_kind(render(), "ConfigMap") if d["metadata"]["name"].endswith("argocd-health")]
    (cm,) = [d for d in by_kind(render({"argocd": {"healthCheck": True}}), "ConfigMap")]
    lua = cm["data"]["resource.customizations.health.spyre-serve.io_SpyreModel"]
    assert lua.strip() == (CHECK / "health.lua").read_text().strip()


def test_every_crd_field_is_documented_for_kubectl_explain():
    crd = yaml.safe_load((REPO / "crds/spyremodels.yaml").read_text())
    missing = []

    def walk(node: dict, path: str) -> None:
        # the API server forbids anything but type on metadata; kubectl explain shows ObjectMeta's own docs
        if path and path != "metadata" and not node.get("description"):
            missing.append(path)
        for key, child in (node.get("properties") or {}).items():
            walk(child, f"{path}.{key}" if path else key)
        items = node.get("items") or {}
        for key, child in (items.get("properties") or {}).items():
            walk(child, f"{path}[].{key}")

    for version in crd["spec"]["versions"]:
        walk(version["schema"]["openAPIV3Schema"], "")
    assert missing == []
