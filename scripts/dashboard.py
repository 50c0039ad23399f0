"""The Grafana dashboard the chart ships (files/dashboards/spyre-serve.json, in a ConfigMap labelled for
Grafana's sidecar): written from the panels below, so its JSON is generated, not edited. Every expression
reads only metrics the runtime and the operator export (tests/test_dashboard.py checks it, and that the file
is this script's output). `--check` says whether the file is up to date."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COMMAND = ".venv/bin/python scripts/dashboard.py"
OUT = Path(__file__).resolve().parents[1] / "charts/spyre-operator/files/dashboards/spyre-serve.json"
UID = "spyre-serve"
# the model pods, as the variables choose them (vLLM's metrics carry model_name; spyre_* ones only the pod's)
SCOPE = 'namespace=~"$namespace", model_name=~"$model"'
MODEL = SCOPE + ', pod=~"$pod"'
POD = 'namespace=~"$namespace", pod=~"$pod"'
RATE = "$__rate_interval"
QUANTILES = (0.5, 0.9, 0.99)


def per(by: str, metric: str, match: str = MODEL) -> str:
    """A rate of a counter of the model pods, summed by `by`."""
    selector = f"{metric}{{{match}}}" if match else metric
    return f"sum by ({by}) (rate({selector}[{RATE}]))"


def quantiles(metric: str) -> list[tuple[str, str]]:
    return [
        (
            f"p{round(q * 100)} {{{{model_name}}}}",
            f"histogram_quantile({q}, sum by (model_name, le) (rate({metric}_bucket{{{MODEL}}}[{RATE}])))",
        )
        for q in QUANTILES
    ]


# (title, unit, description, [(legend, expr)]) by row
MODEL_PANELS = [
    ("Requests running and waiting", "short", "vllm:num_requests_running and _waiting, per model", [
        ("running {{model_name}}", f"sum by (model_name) (vllm:num_requests_running{{{MODEL}}})"),
        ("waiting {{model_name}}", f"sum by (model_name) (vllm:num_requests_waiting{{{MODEL}}})"),
    ]),
    ("Time to first token", "s", "Quantiles of vllm:time_to_first_token_seconds",
     quantiles("vllm:time_to_first_token_seconds")),
    ("Inter-token latency", "s", "Quantiles of vllm:inter_token_latency_seconds",
     quantiles("vllm:inter_token_latency_seconds")),
    ("End-to-end latency", "s", "Quantiles of vllm:e2e_request_latency_seconds",
     quantiles("vllm:e2e_request_latency_seconds")),
    ("Tokens per second", "short", "Generated and prompt tokens per second, per model", [
        ("generated {{model_name}}", per("model_name", "vllm:generation_tokens_total")),
        ("prompt {{model_name}}", per("model_name", "vllm:prompt_tokens_total")),
    ]),
    ("KV cache use and prefix-cache hit rate", "percentunit",
     "vllm:kv_cache_usage_perc per pod; prefix-cache hits over queries (tokens), per model", [
        ("KV cache {{pod}}", f"max by (pod) (vllm:kv_cache_usage_perc{{{MODEL}}})"),
        ("prefix hits {{model_name}}",
         f"{per('model_name', 'vllm:prefix_cache_hits_total')} / "
         f"{per('model_name', 'vllm:prefix_cache_queries_total')}"),
    ]),
    ("Preemptions and paused requests", "short",
     "Requests paused per second (sendnn:pause_events_total) and paused now (sendnn:paused), per pod", [
        ("pauses/s {{pod}}", per("pod", "sendnn:pause_events_total")),
        ("paused {{pod}}", f"max by (pod) (sendnn:paused{{{MODEL}}})"),
    ]),
    ("Warm-up and compile time", "s", "Seconds spent compiling and warming shapes at start-up, per pod", [
        ("warm-up {{pod}}", f"max by (pod) (spyre_warmup_seconds{{{POD}}})"),
    ]),
    ("Warm-up progress", "percentunit", "Graphs compiled and warmed over graphs to warm, per pod", [
        ("{{pod}}", f"max by (pod) (spyre_warmup_graphs_done{{{POD}}})"
         f" / max by (pod) (spyre_warmup_graphs{{{POD}}})"),
    ]),
    ("Requests finished per pod", "reqps", "vllm:request_success_total per pod and finish reason", [
        ("{{pod}} {{finished_reason}}",
         per("pod, finished_reason", "vllm:request_success_total")),
    ]),
]  # fmt: skip
OPERATOR_PANELS = [
    ("Reconciles", "ops", "Reconcile passes per second by result (success, requeue, error)", [
        ("{{result}}", per("result", "spyre_operator_reconciles_total", "")),
    ]),
    ("Failed API calls", "ops", "The operator's failed API calls per second, by kind and HTTP status", [
        ("{{kind}} {{code}}", per("kind, code", "spyre_operator_api_errors_total", "")),
    ]),
    ("Work queue and reconcile time", "short", "Keys waiting in the work queue; reconcile p99 in seconds", [
        ("queue depth", "max(spyre_operator_workqueue_depth)"),
        ("reconcile p99 (s)",
         f"histogram_quantile(0.99, sum by (le) (rate(spyre_operator_reconcile_seconds_bucket[{RATE}])))"),
    ]),
    ("Models by phase", "short", "SpyreModels by phase, as the leader saw them", [
        ("{{phase}}", "max by (phase) (spyre_operator_models)"),
    ]),
]  # fmt: skip


def variable(name: str, label: str, query: str) -> dict:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": name},
        "definition": query,
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
        "sort": 1,
    }


def panel(pid: int, title: str, unit: str, description: str, targets: list, x: int, y: int) -> dict:
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
            for i, (legend, expr) in enumerate(targets)
        ],
    }


def dashboard() -> dict:
    panels, y, pid = [], 0, 1
    for title, rows in (("Models", MODEL_PANELS), ("Operator", OPERATOR_PANELS)):
        panels.append({"id": pid, "type": "row", "title": title, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})  # fmt: skip
        pid, y = pid + 1, y + 1
        for i, spec in enumerate(rows):
            panels.append(panel(pid, *spec, x=12 * (i % 2), y=y + 8 * (i // 2)))
            pid += 1
        y += 8 * ((len(rows) + 1) // 2)
    datasource = {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus"}
    return {
        "uid": UID,
        "title": "spyre-serve",
        "description": f"Models served by spyre-serve and its operator. Generated by `{COMMAND}`.",
        "tags": ["spyre-serve", "vllm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                datasource,
                variable("namespace", "Namespace", "label_values(vllm:num_requests_running, namespace)"),
                variable(
                    "model",
                    "Model",
                    'label_values(vllm:num_requests_running{namespace=~"$namespace"}, model_name)',
                ),
                variable("pod", "Pod", f"label_values(vllm:num_requests_running{{{SCOPE}}}, pod)"),
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail when the file is not this script's output")
    args = parser.parse_args(argv)
    if args.check:
        if not OUT.exists() or OUT.read_text() != render():
            print(f"{OUT} differs from what the script gives: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(render())
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
