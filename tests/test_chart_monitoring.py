"""The chart's monitoring objects (issue 41), rendered by the real Helm engine: a PodMonitor over every
inference pod (metrics.podMonitor) and the alerts' PrometheusRule (alerts.enabled). Off by default: a cluster
without prometheus-operator's CRDs refuses them, which the real control plane shows; with the CRDs (a minimal,
typed copy), the API server keeps every field the chart sets, and the PodMonitor's selector picks the pods
the operator builds and leaves out its compile pods."""

from __future__ import annotations

import copy

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException
from spyre_operator.kinds.pods.template import build_pod
from spyre_operator.settings import COMPILE_LABEL, MODEL_LABEL, OperatorSettings

from tests.conftest import REPO, kubectl
from tests.operator.objects import MODEL, spec_of
from tests.test_chart import CHART, by_kind, render

CRDS = REPO / "tests/cluster/crds/monitoring-coreos.yaml"
GROUP, VERSION = "monitoring.coreos.com", "v1"
ON = {"metrics": {"podMonitor": True}, "alerts": {"enabled": True}}


def test_lint_is_clean_with_everything_on():
    values = {**ON, "dashboard": {"enabled": True}, "metrics": {"podMonitor": True, "serviceMonitor": True}}
    report = helm.lint(str(CHART), values, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []
    (dashboard,) = [
        c for c in by_kind(render(values), "ConfigMap") if c["metadata"]["name"].endswith("board")
    ]
    kubernetes_validate.validate(dashboard, kubernetes_validate.latest_version(), strict=True)


def selector_string(selector: dict) -> str:
    """A PodMonitor's selector as a label selector for the API server (the forms the chart uses)."""
    parts = [f"{k}={v}" for k, v in selector.get("matchLabels", {}).items()]
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "Exists", e
        parts.append(e["key"])
    return ",".join(parts)


def test_off_by_default_and_on_by_value():
    assert not by_kind(render(), "PodMonitor") and not by_kind(render(), "PrometheusRule")
    (monitor,) = by_kind(render(ON), "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert selector_string(monitor["spec"]["selector"]) == MODEL_LABEL
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    pod = build_pod(MODEL, spec_of(), OperatorSettings())
    assert endpoint["port"] in {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert endpoint["path"] == "/metrics"
    scoped = by_kind(render({**ON, "watchNamespaces": ["team-a", "team-b"]}), "PodMonitor")[0]
    assert scoped["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    labelled = render({**ON, "metrics": {"podMonitor": True, "monitorLabels": {"release": "kps"}}})
    assert by_kind(labelled, "PodMonitor")[0]["metadata"]["labels"]["release"] == "kps"
    assert (
        by_kind(render({"alerts": {"enabled": True, "labels": {"release": "kps"}}}), "PrometheusRule")[0][
            "metadata"
        ]["labels"]["release"]
        == "kps"
    )


def create(custom: client.CustomObjectsApi, doc: dict, namespace: str) -> dict:
    plural = doc["kind"].lower() + "s"
    body = {**copy.deepcopy(doc), "metadata": {**doc["metadata"], "namespace": namespace}}
    return custom.create_namespaced_custom_object(GROUP, VERSION, namespace, plural, body)


@pytest.mark.cluster
def test_on_the_control_plane_without_and_with_prometheus_operators_crds(cluster, kube):
    ns = "spyre-monitoring"
    core, custom = client.CoreV1Api(kube), client.CustomObjectsApi(kube)
    core.create_namespace({"metadata": {"name": ns}})
    docs = render(ON)
    monitor, rule = by_kind(docs, "PodMonitor")[0], by_kind(docs, "PrometheusRule")[0]
    try:
        for doc in (monitor, rule):  # without the CRDs: the API server does not serve the kinds
            with pytest.raises(ApiException) as refused:
                create(custom, doc, ns)
            assert refused.value.status == 404
        kubectl(cluster, "apply", "-f", str(CRDS))
        for name in ("podmonitors", "prometheusrules"):
            kubectl(cluster, "wait", "--for=condition=established", "--timeout=60s", f"crd/{name}.{GROUP}")
        for doc in (monitor, rule):  # every field the chart sets is in the schema: none pruned
            assert create(custom, doc, ns)["spec"] == doc["spec"], doc["kind"]

        model = {**MODEL, "metadata": {**MODEL["metadata"], "namespace": ns}}
        pod = build_pod(model, spec_of(), OperatorSettings())
        pod["metadata"].pop("ownerReferences")  # no SpyreModel object here: the pod stands alone
        made = core.create_namespaced_pod(ns, pod)
        compile_pod = {
            "metadata": {"name": "granite-compile", "labels": {COMPILE_LABEL: "granite"}},
            "spec": {"containers": [{"name": "c", "image": "example.org/x"}]},
        }
        core.create_namespaced_pod(ns, compile_pod)
        selected = core.list_namespaced_pod(ns, label_selector=selector_string(monitor["spec"]["selector"]))
        assert [p.metadata.name for p in selected.items] == [made.metadata.name]
    finally:
        core.delete_namespace(ns)
        kubectl(cluster, "delete", "--ignore-not-found", "-f", str(CRDS))


def test_the_crds_for_the_test_are_the_kinds_the_chart_renders():
    kinds = {d["spec"]["names"]["kind"] for d in yaml.safe_load_all(CRDS.read_text())}
    assert kinds == {"PodMonitor", "PrometheusRule"}
