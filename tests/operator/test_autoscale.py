"""Behind a gateway, with an autoscaler, on the real control plane.

Autoscaling through an existing engine, not a home-made one: the real HorizontalPodAutoscaler controller of
the control plane's kube-controller-manager drives a SpyreModel through its /scale subresource, on an external
metric (a queue length, as KEDA's Prometheus trigger on `vllm:num_requests_waiting` would report it) served by
a test-only external metrics API behind a real APIService (tests/cluster/external_metrics.py). The operator
follows the replica count and never writes spec.replicas itself; scaled to zero, the model keeps its Service,
its graph-cache claim and its InferencePool.

The InferencePool per model (Gateway API Inference Extension v1), with the CRD written from its published API
(tests/cluster/crds/inferencepool.yaml) installed for a test and removed after it (the session's control plane
is shared and has none): made, owned, repaired after drift, removed when turned off, garbage-collected with
the model; without the CRD, skipped with a condition and one Event, and made once the CRD is installed."""

from __future__ import annotations

import json
import threading
import time

import pytest
import yaml
from kubernetes import client, watch

from tests.cluster.external_metrics import ExternalMetrics
from tests.conftest import REPO, wait_for
from tests.operator.conftest import GROUP, PLURAL, VERSION

pytestmark = pytest.mark.cluster

SPEC = {
    "model": {"source": "pvc://models/tiny"},
    "cards": 1,
    "replicas": 1,
    "backend": "inductor",
    "batching": {"mode": "static", "shapes": [{"promptLength": 64, "newTokens": 20, "batchSize": 1}]},
}


@pytest.fixture(scope="module")
def external_metrics(cluster):
    metrics = ExternalMetrics(cluster).start()
    try:
        yield metrics
    finally:
        metrics.stop()


def hpa_manifest(namespace: str, metric: str) -> dict:
    fast = {"stabilizationWindowSeconds": 0, "policies": [{"type": "Pods", "value": 4, "periodSeconds": 1}]}
    return {
        "apiVersion": "autoscaling/v2beta2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "m", "namespace": namespace},
        "spec": {
            "scaleTargetRef": {"apiVersion": f"{GROUP}/{VERSION}", "kind": "SpyreModel", "name": "m"},
            "minReplicas": 1,
            "maxReplicas": 3,
            "metrics": [
                {
                    "type": "External",
                    "external": {
                        "metric": {"name": metric},
                        "target": {"type": "AverageValue", "averageValue": "2"},
                    },
                }
            ],
            "behavior": {"scaleUp": fast, "scaleDown": fast},
        },
    }


def replicas_seen(kube, namespace: str, stop: threading.Event, seen: list[int]) -> None:
    """Records every spec.replicas the SpyreModel takes (a writer fighting the HPA would show as flapping)."""
    custom = client.CustomObjectsApi(kube)
    w = watch.Watch()
    while not stop.is_set():
        for ev in w.stream(
            custom.list_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, timeout_seconds=2
        ):
            replicas = ev["object"]["spec"].get("replicas")
            if not seen or seen[-1] != replicas:
                seen.append(replicas)


def test_a_real_hpa_scales_a_spyremodel_up_and_down_and_the_operator_follows(
    cluster, operator, ns, external_metrics
):
    metric = f"waiting-{ns.name}"
    external_metrics.values[metric] = 0
    ns.apply_model("m", SPEC)
    ns.wait_ready("m", 1)
    status = ns.model("m")["status"]
    assert status["replicas"] == 1 and status["selector"] == "spyre-serve.io/model=m"
    generation = ns.model("m")["metadata"]["generation"]
    seen: list[int] = []
    stop = threading.Event()
    recorder = threading.Thread(target=replicas_seen, args=(ns.kube, ns.name, stop, seen), daemon=True)
    recorder.start()
    path = cluster.workdir / f"hpa-{ns.name}.json"
    path.write_text(json.dumps(hpa_manifest(ns.name, metric)))
    cluster.kubectl("apply", "-f", str(path))
    try:
        external_metrics.values[metric] = 7  # 7 waiting at 2 a replica: 4, capped at maxReplicas 3
        ns.wait_ready("m", 3, timeout=120)
        assert len(ns.pods("m")) == 3
        external_metrics.values[metric] = 0  # idle: back to minReplicas
        ns.wait_ready("m", 1, timeout=120)
        wait_for(lambda: len(ns.pods("m")) == 1, timeout=60, what="the extra pods removed")
    finally:
        stop.set()
        recorder.join(timeout=10)
        cluster.kubectl("delete", "-f", str(path), "--wait=false", check=False)
    hpa_reads = [p for p in external_metrics.requests if p.endswith(f"/namespaces/{ns.name}/{metric}")]
    assert hpa_reads, "the HPA controller never read the metric"
    assert seen == [1, 3, 1], seen  # the HPA's two writes, nothing fighting them
    # spec.replicas changed twice (by the HPA); any other spec write (the operator's) would bump it more
    assert ns.model("m")["metadata"]["generation"] == generation + 2


def test_scaled_to_zero_keeps_the_service_and_the_cache_claim(operator, ns):
    ns.apply_model("z", SPEC)
    ns.wait_ready("z", 1)
    custom = client.CustomObjectsApi(ns.kube)
    custom.patch_namespaced_custom_object_scale(
        GROUP, VERSION, ns.name, PLURAL, "z", {"spec": {"replicas": 0}}
    )
    wait_for(lambda: not ns.pods("z"), timeout=60, what="the pods of z removed")
    status = wait_for(
        lambda: (st := ns.model("z").get("status") or {}).get("replicas") == 0 and st,
        what="status.replicas 0",
    )
    assert status["selector"] == "spyre-serve.io/model=z"
    assert ns.core.read_namespaced_service("z", ns.name).spec.selector == {"spyre-serve.io/model": "z"}
    claims = [c.metadata.name for c in ns.core.list_namespaced_persistent_volume_claim(ns.name).items]
    assert any(name.startswith("z-") for name in claims), claims
    custom.patch_namespaced_custom_object_scale(
        GROUP, VERSION, ns.name, PLURAL, "z", {"spec": {"replicas": 1}}
    )
    ns.wait_ready("z", 1)


# ---- the InferencePool -------------------------------------------------------------------------------

POOL_CRD = "inferencepools.inference.networking.k8s.io"
POOL_API = ("inference.networking.k8s.io", "v1")


def without_empty_defaults(schema):
    """The 1.20 API server reads an empty string default (endpointPickerRef.group: "") as null and refuses the
    CRD; the operator writes that field itself, so the test control plane goes without the default."""
    if isinstance(schema, dict):
        return {k: without_empty_defaults(v) for k, v in schema.items() if not (k == "default" and v == "")}
    if isinstance(schema, list):
        return [without_empty_defaults(v) for v in schema]
    return schema


def install_pool_crd(cluster) -> None:
    crd = yaml.safe_load((REPO / "tests/cluster/crds/inferencepool.yaml").read_text())
    path = cluster.workdir / "inferencepool-crd.json"
    path.write_text(json.dumps(without_empty_defaults(crd)))
    # the 1.20 API server does not know x-kubernetes-validations: kubectl's own validation would refuse them
    cluster.kubectl("apply", "--validate=false", "-f", str(path))
    cluster.kubectl("wait", "--for=condition=established", "--timeout=60s", f"crd/{POOL_CRD}")


def uninstall_pool_crd(cluster) -> None:
    cluster.kubectl("delete", "crd", POOL_CRD, "--ignore-not-found", "--timeout=90s", check=False)
    wait_for(lambda: not pool_crd_installed(cluster), timeout=90, what="the InferencePool CRD removed")


def pool_crd_installed(cluster) -> bool:
    return POOL_CRD in cluster.kubectl("get", "crd", "-o", "name").stdout


@pytest.fixture()
def pool_crd(cluster):
    """The InferencePool CRD for one test; the shared control plane is left without it, as it was found."""
    assert not pool_crd_installed(cluster)
    install_pool_crd(cluster)
    try:
        yield POOL_CRD
    finally:
        uninstall_pool_crd(cluster)


def pool(ns, name: str) -> dict | None:
    try:
        return ns.custom.get_namespaced_custom_object(*POOL_API, ns.name, "inferencepools", name)
    except client.ApiException as e:
        if e.status == 404:
            return None
        raise


def pool_condition(ns, name: str) -> dict:
    return ns.condition(name, "InferencePoolReady")


def events_of(ns, name: str, reason: str) -> list:
    return [e for e in ns.events(name) if e.reason == reason]


def test_without_the_crd_the_model_serves_says_why_once_and_gets_its_pool_once_it_is_installed(
    cluster, operator, ns
):
    assert not pool_crd_installed(cluster)
    ns.apply_model("g", {**SPEC, "inferencePool": {}})
    ns.wait_ready("g", 1)  # the model serves through its Service
    cond = wait_for(
        lambda: (c := pool_condition(ns, "g")).get("reason") == "InferencePoolUnavailable" and c,
        what="InferencePoolReady False, InferencePoolUnavailable",
    )
    assert (
        cond["status"] == "False" and "install the Gateway API Inference Extension's CRDs" in cond["message"]
    )
    assert (
        ns.condition("g", "Ready")["status"] == "True" and ns.condition("g", "Stalled")["status"] == "False"
    )
    wait_for(lambda: events_of(ns, "g", "InferencePoolUnavailable"), what="an InferencePoolUnavailable Event")
    errors = operator.metric("spyre_operator_reconciles_total", 'result="error"')
    version = ns.model("g")["metadata"]["resourceVersion"]
    time.sleep(8)  # more than two resync periods (3 s): asked again, no retry loop, nothing rewritten
    assert len(events_of(ns, "g", "InferencePoolUnavailable")) == 1
    assert operator.metric("spyre_operator_reconciles_total", 'result="error"') == errors
    assert ns.model("g")["metadata"]["resourceVersion"] == version
    install_pool_crd(cluster)
    try:
        made = wait_for(
            lambda: pool(ns, "g"), timeout=60, what="the InferencePool made once the CRD is there"
        )
        assert made["spec"]["selector"]["matchLabels"] == {
            "spyre-serve.io/model": "g",
            "app.kubernetes.io/component": "inference",
        }
        assert made["metadata"]["ownerReferences"][0]["uid"] == ns.model("g")["metadata"]["uid"]
        wait_for(lambda: pool_condition(ns, "g").get("status") == "True", what="InferencePoolReady True")
        assert pool_condition(ns, "g")["reason"] == "Reconciled"
        assert events_of(ns, "g", "InferencePoolCreated")
    finally:
        uninstall_pool_crd(cluster)


def test_the_pool_is_made_repaired_kept_at_zero_removed_when_off_and_collected_with_the_model(
    cluster, operator, ns, pool_crd
):
    picker = {"name": "router", "port": {"number": 9002}, "failureMode": "FailOpen"}
    ns.apply_model("p", {**SPEC, "replicas": 2, "inferencePool": {"endpointPickerRef": picker}})
    ns.apply_model("q", {**SPEC, "inferencePool": {}})
    ns.wait_ready("p", 2)
    made = wait_for(lambda: pool(ns, "p"), what="the InferencePool of p")
    spec = made["spec"]
    assert spec["targetPorts"] == [{"number": 8000}] and spec["appProtocol"] == "http"
    assert spec["endpointPickerRef"] == {"kind": "Service", **picker}
    owner = made["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("SpyreModel", "p", True)
    # exactly the model's serving pods, which tell the endpoint picker they speak vLLM's metric names
    selector = ",".join(f"{k}={v}" for k, v in spec["selector"]["matchLabels"].items())
    selected = ns.core.list_namespaced_pod(ns.name, label_selector=selector).items
    assert sorted(p.metadata.name for p in selected) == sorted(p.metadata.name for p in ns.pods("p"))
    assert all(p.metadata.labels["llm-d.ai/engine-type"] == "vllm" for p in selected)

    # drift: someone points the pool elsewhere; the operator restores what it owns
    drift = [
        {"op": "replace", "path": "/spec/selector", "value": {"matchLabels": {"app": "other"}}},
        {"op": "replace", "path": "/spec/targetPorts", "value": [{"number": 9000}]},
    ]
    ns.custom.patch_namespaced_custom_object(
        *POOL_API, ns.name, "inferencepools", "p", drift, _content_type="application/json-patch+json"
    )
    wait_for(lambda: pool(ns, "p")["spec"] == spec, timeout=30, what="the InferencePool repaired")
    assert wait_for(
        lambda: events_of(ns, "p", "InferencePoolRepaired"), what="an InferencePoolRepaired Event"
    )

    # scaled to zero: the pool stays as it is
    ns.custom.patch_namespaced_custom_object_scale(
        GROUP, VERSION, ns.name, PLURAL, "p", {"spec": {"replicas": 0}}
    )
    wait_for(lambda: not ns.pods("p"), timeout=60, what="the pods of p removed")
    wait_for(lambda: ns.condition("p", "Ready").get("reason") == "ScaledToZero", what="p scaled to zero")
    assert pool(ns, "p")["spec"] == spec and pool_condition(ns, "p")["status"] == "True"

    # turned off: the operator removes it, and the condition goes
    ns.patch_spec("p", {"inferencePool": {"enabled": False}})
    wait_for(lambda: pool(ns, "p") is None, what="the InferencePool of p removed")
    wait_for(lambda: not pool_condition(ns, "p"), what="the InferencePoolReady condition gone")

    # the model deleted: its pool is garbage-collected with it
    wait_for(lambda: pool(ns, "q"), what="the InferencePool of q")
    ns.custom.delete_namespaced_custom_object(GROUP, VERSION, ns.name, PLURAL, "q")
    wait_for(lambda: pool(ns, "q") is None, timeout=120, what="the InferencePool of q garbage-collected")


def test_a_crd_removed_while_watched_stops_no_operator(cluster, operator, ns):
    """kopf answers a watch that starts as its CRD goes (404 Not Found) by stopping the whole operator (seen
    in `make test`: every later test waited on a dead operator); ours watches again (__main__.run_reactor).
    The InferencePool CRD installed and removed at once, eight times: the operator lives and reconciles."""
    for i in range(8):
        install_pool_crd(cluster)
        time.sleep(0.25 * (i % 4))  # removed as kopf starts its watch, or a moment after
        uninstall_pool_crd(cluster)
    assert operator.proc.poll() is None, operator.log()
    ns.apply_model("after-churn", SPEC)
    ns.wait_ready("after-churn", 1)
    assert operator.proc.poll() is None, operator.log()
