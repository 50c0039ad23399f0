"""The Grafana dashboard (scripts/dashboard.py, shipped by the chart as a ConfigMap for Grafana's sidecar):
the file is the script's output, the chart carries it unchanged, it has the issue's panels, and every PromQL
expression parses (promtool) and reads only metrics the runtime and the operator export."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import yaml

from tests.conftest import REPO
from tests.monitoring import exported_metric_names, metric_names_in, prometheus_bin
from tests.test_chart import by_kind, render

SCRIPT = REPO / "scripts/dashboard.py"
FILE = REPO / "charts/spyre-operator/files/dashboards/spyre-serve.json"


def generator():
    spec = importlib.util.spec_from_file_location("dashboard", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expressions(board: dict) -> list[tuple[str, str]]:
    """(where, expr) of every panel target and query variable."""
    found = [
        (f"panel {p['title']!r}", t["expr"])
        for p in board["panels"]
        if p["type"] != "row"
        for t in p["targets"]
    ]
    for v in board["templating"]["list"]:
        if v["type"] == "query":  # label_values(SELECTOR, label): the selector is PromQL
            query = v["query"]["query"]
            assert query.startswith("label_values(") and query.endswith(")"), query
            found.append((f"variable {v['name']}", query[len("label_values(") :].rsplit(",", 1)[0]))
    return found


def test_the_file_is_the_scripts_output():
    gen = generator()
    assert FILE.read_text() == gen.render(), f"{FILE.relative_to(REPO)} is stale: run `{gen.COMMAND}`"
    check = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_the_chart_ships_it_for_grafanas_sidecar():
    default = by_kind(render(), "ConfigMap")
    assert [c for c in default if "grafana_dashboard" in c["metadata"].get("labels", {})] == []  # off
    values = {
        "dashboard": {"enabled": True, "namespace": "monitoring", "annotations": {"grafana_folder": "AI"}}
    }
    (cm,) = [c for c in by_kind(render(values), "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "AI"}
    assert json.loads(cm["data"]["spyre-serve.json"]) == json.loads(FILE.read_text())


def test_it_has_the_issues_panels_in_two_rows():
    board = json.loads(FILE.read_text())
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == ["Models", "Operator"]
    exprs = " ".join(e for _, e in expressions(board))
    for metric in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:generation_tokens_total",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "sendnn:pause_events_total",
        "sendnn:paused",
        "spyre_warmup_seconds",
        "spyre_operator_reconciles_total",
        "spyre_operator_api_errors_total",
    ):
        assert metric in exprs, f"no panel reads {metric}"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "namespace", "model", "pod"}


def test_every_expression_reads_exported_metrics_and_parses(tmp_path):
    exported = exported_metric_names()
    found = expressions(json.loads(FILE.read_text()))
    for where, expr in found:
        names = metric_names_in(expr)
        assert names, f"{where} reads none of our metrics: {expr}"
        missing = sorted(names - exported)
        assert not missing, f"{where} reads metrics nothing exports: {missing}"
    # promtool parses each one, Grafana's $__rate_interval and variables given values
    records = [
        {"record": f"check:expr_{i}", "expr": expr.replace("$__rate_interval", "5m")}
        for i, (_, expr) in enumerate(found)
    ]
    (tmp_path / "exprs.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]})
    )
    checked = subprocess.run(
        [str(prometheus_bin("promtool")), "check", "rules", "exprs.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(records)} rules found" in checked.stdout
