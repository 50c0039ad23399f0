"""What Prometheus scrapes, per model: the PodMonitor the operator owns (kinds/pod_monitor.py), built and
checked without a cluster, then on the real control plane with the operator as a subprocess — without
prometheus-operator's CRD (no monitor, no error, said in the start-up log) and with it
(tests/cluster/crds/monitoring-coreos.yaml, installed for the test and removed after it: made, owned,
selecting the model's serving pods once the model changes, repaired after drift).
And the chart values that reach the operator's settings."""

from __future__ import annotations

import copy
import json
import time

import pytest
from kubernetes import client
from spyre_operator.admission import check_spec
from spyre_operator.kinds.compile_job import build_compile_job, cache_key
from spyre_operator.kinds.pod_monitor import api_line, build_pod_monitor, monitor_repair
from spyre_operator.kinds.pods.template import build_pod
from spyre_operator.settings import OperatorSettings, SettingsError, load_settings

from tests.conftest import REPO, wait_for
from tests.operator.catalog import model_object
from tests.test_chart import by_kind, env_of, render

SETTINGS = OperatorSettings()
GROUP, VERSION = "monitoring.coreos.com", "v1"
CRDS = REPO / "tests/cluster/crds/monitoring-coreos.yaml"


model = model_object


def selects(monitor: dict, labels: dict) -> bool:
    return monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_monitor_selects_the_serving_pods_metrics_port():
    m = model(graphCache={"precompile": True})
    spec = check_spec("granite", m["spec"], SETTINGS)
    monitor = build_pod_monitor(m, SETTINGS)
    pod = build_pod(m, spec, SETTINGS)
    job = build_compile_job(m, spec, SETTINGS, cache_key(spec, SETTINGS))
    assert selects(monitor, pod["metadata"]["labels"])
    assert not selects(monitor, job["spec"]["template"]["metadata"]["labels"])
    assert not selects(
        monitor, build_pod_monitor(model("other"), SETTINGS)["spec"]["selector"]["matchLabels"]
    )
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ports = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert endpoint == {"port": "http", "path": "/metrics", "interval": "15s"} and "http" in ports
    owner = monitor["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("SpyreModel", "u-1", True)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    labelled = OperatorSettings(pod_monitor_labels=(("release", "kps"),), pod_monitor_interval="30s")
    monitor = build_pod_monitor(m, labelled)
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["podMetricsEndpoints"][0]["interval"] == "30s"


def test_drift_is_repaired_field_by_field():
    want = build_pod_monitor(model(), SETTINGS)
    assert monitor_repair(copy.deepcopy(want), want) is None
    have = copy.deepcopy(want)
    have["spec"]["podMetricsEndpoints"][0]["port"] = "metrics"
    assert monitor_repair(have, want) == [
        {"op": "add", "path": "/spec/podMetricsEndpoints", "value": want["spec"]["podMetricsEndpoints"]}
    ]


def test_the_settings_and_their_errors():
    s = load_settings(
        {
            "SPYRE_OPERATOR_POD_MONITORS": "0",
            "SPYRE_OPERATOR_POD_MONITOR_INTERVAL": "1m",
            "SPYRE_OPERATOR_POD_MONITOR_LABELS": '{"release": "kps"}',
        }
    )
    assert (s.pod_monitors, s.pod_monitor_interval, s.pod_monitor_labels) == (
        False,
        "1m",
        (("release", "kps"),),
    )
    assert load_settings({}).pod_monitors is True
    for var, value, said in [
        ("SPYRE_OPERATOR_POD_MONITOR_INTERVAL", "15", "Prometheus duration"),
        ("SPYRE_OPERATOR_POD_MONITOR_LABELS", "release=kps", "JSON object"),
        ("SPYRE_OPERATOR_POD_MONITOR_LABELS", '{"a": 1}', "JSON object"),
    ]:
        with pytest.raises(SettingsError, match=said) as e:
            load_settings({var: value})
        assert var in str(e.value)


def test_the_chart_turns_per_model_monitors_off_when_its_own_monitor_scrapes():
    env = env_of(by_kind(render(), "Deployment")[0])
    assert (env["SPYRE_OPERATOR_POD_MONITORS"], env["SPYRE_OPERATOR_POD_MONITOR_INTERVAL"]) == ("1", "15s")
    assert "SPYRE_OPERATOR_POD_MONITOR_LABELS" not in env
    chart_level = {"metrics": {"podMonitor": True, "monitorLabels": {"release": "kps"}}}
    env = env_of(by_kind(render(chart_level), "Deployment")[0])
    assert env["SPYRE_OPERATOR_POD_MONITORS"] == "0"
    assert json.loads(env["SPYRE_OPERATOR_POD_MONITOR_LABELS"]) == {"release": "kps"}
    env = env_of(by_kind(render({"metrics": {"perModelPodMonitor": False}}), "Deployment")[0])
    assert env["SPYRE_OPERATOR_POD_MONITORS"] == "0"
    settings = load_settings(
        {k: v for k, v in env_of(by_kind(render(chart_level), "Deployment")[0]).items() if v is not None}
    )
    assert settings.pod_monitor_labels == (("release", "kps"),) and not settings.pod_monitors


# ---- on the real control plane ----------------------------------------------------------------------


SPEC = {
    "model": {"source": "pvc://models/tiny"},
    "cards": 1,
    "replicas": 1,
    "backend": "inductor",
    "batching": {"mode": "static", "shapes": [{"promptLength": 64, "newTokens": 20, "batchSize": 1}]},
}


def monitor_of(ns, name: str) -> dict | None:
    try:
        return ns.custom.get_namespaced_custom_object(GROUP, VERSION, ns.name, "podmonitors", name)
    except client.ApiException as e:
        if e.status == 404:
            return None
        raise


def crd_installed(cluster) -> bool:
    return "podmonitors.monitoring.coreos.com" in cluster.kubectl("get", "crd", "-o", "name").stdout


@pytest.mark.cluster
def test_without_the_crd_no_monitor_and_no_error_then_one_once_it_is_installed(cluster, operator, ns):
    assert not crd_installed(cluster)
    ns.apply_model("g", SPEC)
    ns.wait_ready("g", 1)  # the model serves; nothing about monitors holds it back
    assert api_line(False) in operator.log()  # said at start-up: absent
    errors = operator.metric("spyre_operator_reconciles_total", 'result="error"')
    time.sleep(4)  # more than a resync period (3 s): asked again, no error
    assert operator.metric("spyre_operator_reconciles_total", 'result="error"') == errors
    assert not [e for e in ns.events("g") if "PodMonitor" in e.reason]
    cluster.kubectl("apply", "-f", str(CRDS))
    cluster.kubectl("wait", "--for=condition=established", "--timeout=60s", "crd/podmonitors." + GROUP)
    try:
        ns.patch_spec("g", {"replicas": 2})  # a change: asked again (a steady model is not), and made
        made = wait_for(lambda: monitor_of(ns, "g"), timeout=30, what="the model's PodMonitor")
        assert made["metadata"]["ownerReferences"][0]["uid"] == ns.model("g")["metadata"]["uid"]
        assert made["spec"] == build_pod_monitor(ns.model("g"), OperatorSettings())["spec"]  # none pruned
        selector = ",".join(f"{k}={v}" for k, v in made["spec"]["selector"]["matchLabels"].items())
        # both replicas first: the second pod could appear between the two lists (the test's race)
        wait_for(lambda: len(ns.pods("g")) == 2, timeout=60, what="the second replica's pod")
        pods = ns.core.list_namespaced_pod(ns.name, label_selector=selector).items
        assert sorted(p.metadata.name for p in pods) == sorted(p.metadata.name for p in ns.pods("g"))
        assert api_line(True) in operator.log()
        wait_for(lambda: [e for e in ns.events("g") if e.reason == "PodMonitorCreated"], what="an Event")
        # drift: someone points it elsewhere; the next generation's pass restores it
        ns.custom.patch_namespaced_custom_object(
            GROUP, VERSION, ns.name, "podmonitors", "g", {"spec": {"podMetricsEndpoints": [{"port": "x"}]}}
        )
        ns.patch_spec("g", {"replicas": 1})
        wait_for(
            lambda: monitor_of(ns, "g")["spec"]["podMetricsEndpoints"] == made["spec"]["podMetricsEndpoints"],
            timeout=30,
            what="the PodMonitor's endpoints restored",
        )
    finally:
        cluster.kubectl("delete", "--ignore-not-found", "--timeout=90s", "-f", str(CRDS), check=False)
        wait_for(lambda: not crd_installed(cluster), timeout=90, what="the monitoring CRDs removed")
