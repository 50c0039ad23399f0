"""A real Prometheus (Debian's binary, on 127.0.0.1, stopped by PID) scrapes a served runtime and the
operator's metrics endpoint, with the chart's alert rules loaded: after a few requests every dashboard
expression returns at least one series (a panel that would be blank is a failure), and every alert rule
evaluates without error. The runtime is the real server on a tiny model; the operator's endpoint is its real
exporter (io/metrics.py) fed one reconcile and one failed API call, as a running operator would be."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import yaml
from spyre_operator.io.metrics import OperatorMetrics, serve_health
from spyre_runtime.testing.models import write_tiny_model

from tests.cluster.controlplane import Proc, free_port, terminate
from tests.conftest import wait_for
from tests.httpclient import HTTP
from tests.monitoring import prometheus_bin
from tests.runtime.serverproc import ServerProcess
from tests.test_chart import by_kind, render
from tests.test_dashboard import FILE as DASHBOARD
from tests.test_dashboard import expressions

ENV = {"SENDNN_INFERENCE_DYNAMO_BACKEND": "eager", "SENDNN_INFERENCE_USE_CB": "1"}
ARGS = ("--max-model-len", "256", "--max-num-seqs", "4")
# Grafana's variables and interval, as a dashboard opened on everything would give them
GRAFANA = {"$__rate_interval": "30s", "$namespace": ".*", "$model": ".*", "$pod": ".*"}


@pytest.fixture(scope="module")
def operator_endpoint():
    metrics = OperatorMetrics()
    metrics.reconciles.labels("success").inc()
    metrics.api_errors.labels("Pod", "409").inc()
    metrics.reconcile_seconds.observe(0.02)
    metrics.observe_model(("ml", "tiny"), "Ready", Counter(ready=1), "succeeded")
    server = serve_health(0, metrics, lambda: True, host="127.0.0.1")
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prom-runtime")
    srv = ServerProcess(write_tiny_model(folder / "model", arch="llama", seed=0), ENV, folder / "server.log",
                        extra_args=ARGS)  # fmt: skip
    with srv.serving():
        yield srv


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory, runtime, operator_endpoint):
    folder = tmp_path_factory.mktemp("prometheus")
    (rule,) = by_kind(render({"alerts": {"enabled": True}}), "PrometheusRule")
    (folder / "rules.yaml").write_text(yaml.safe_dump(rule["spec"]))
    target = f"127.0.0.1:{runtime.port}"
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules.yaml"],
        "scrape_configs": [
            {"job_name": "runtime", "static_configs": [
                {"targets": [target], "labels": {"namespace": "ml", "pod": "tiny-0"}}]},
            {"job_name": "operator", "static_configs": [{"targets": [operator_endpoint]}]},
        ],
    }  # fmt: skip
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = folder / "prometheus.log"
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            [str(prometheus_bin("prometheus")), "--config.file=prometheus.yml",
             f"--storage.tsdb.path={folder}/data", f"--web.listen-address=127.0.0.1:{port}"],
            cwd=folder, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    proc = Proc("prometheus", popen.pid, log, popen)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, popen, log)
        yield base
    finally:
        terminate(proc, grace=10)


def wait_ready(base: str, popen: subprocess.Popen, log: Path) -> None:
    """Prometheus answers 503 until its storage and rules are loaded (/-/ready): waited for, or its log."""

    def ready() -> bool:
        assert popen.poll() is None, f"prometheus exited {popen.returncode}: {log.read_text()[-2000:]}"
        return HTTP.get(f"{base}/-/ready", timeout=5).status_code == 200

    wait_for(ready, timeout=120, what="prometheus /-/ready", step=0.5)


def query(base: str, expr: str) -> list:
    response = HTTP.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10)
    response.raise_for_status()  # a 503 while it starts: wait_for_data asks again
    body = response.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def wait_for_data(base: str, exprs: list[str], timeout: float = 60) -> dict[str, list]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            results = {e: query(base, e) for e in exprs}
        except httpx.HTTPError:
            results = {}
        if (results and all(results.values())) or time.monotonic() > deadline:
            return results
        time.sleep(1)


def grafana(expr: str) -> str:
    for var, value in GRAFANA.items():
        expr = expr.replace(var, value)
    return expr


def test_every_panel_and_rule_has_data_from_a_served_model(runtime, prometheus):
    client = runtime.client(timeout=120)
    for i in range(3):
        client.completions.create(model="tiny", prompt=f"hello {i}", max_tokens=8)
    found = expressions(json.loads(DASHBOARD.read_text()))
    exprs = [grafana(e) for _, e in found]
    results = wait_for_data(prometheus, exprs)
    blank = [where for (where, _), e in zip(found, exprs, strict=True) if not results.get(e)]
    assert not blank, f"panels with no data: {blank}"
    up = {r["metric"]["job"]: r["value"][1] for r in query(prometheus, "up")}
    assert up == {"runtime": "1", "operator": "1"}
    served = query(prometheus, 'sum(vllm:request_success_total{finished_reason="length", model_name="tiny"})')
    assert float(served[0]["value"][1]) >= 3
    groups = HTTP.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == 10
    deadline = time.monotonic() + 10
    while any(r.get("lastEvaluation", "").startswith("0001") for r in rules) and time.monotonic() < deadline:
        time.sleep(1)
        rules = [
            r for g in HTTP.get(f"{prometheus}/api/v1/rules").json()["data"]["groups"] for r in g["rules"]
        ]
    assert [(r["name"], r["health"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
