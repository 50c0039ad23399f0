"""Autoscaling through an existing engine, not a home-made one: the real HorizontalPodAutoscaler controller of
the control plane's kube-controller-manager drives a SpyreModel through its /scale subresource, on an external
metric (a queue length, as KEDA's Prometheus trigger on `vllm:num_requests_waiting` would report it) served by
a test-only external metrics API behind a real APIService (tests/cluster/external_metrics.py). The operator
follows the replica count and never writes spec.replicas itself; scaled to zero, the model keeps its Service
and its graph-cache claim."""

from __future__ import annotations

import json
import threading

import pytest
from kubernetes import client, watch

from tests.cluster.external_metrics import ExternalMetrics
from tests.conftest import wait_for
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
