"""The examples of "Behind a gateway, with an autoscaler", without a cluster: the SpyreModel with an
InferencePool and the HTTPRoute to it, an HPA (checked against the published Kubernetes schemas with
kubernetes-validate) and a KEDA ScaledObject (checked against a JSON Schema of our own, written from KEDA's
documented ScaledObject fields and its prometheus trigger's parameters: KEDA's CRD is not available offline);
both drive the example's SpyreModel on its pods' vllm:num_requests_waiting."""

from __future__ import annotations

import re

import jsonschema
import kubernetes_validate
import pytest
import yaml
from spyre_operator.admission import check_spec
from spyre_operator.kinds.inference_pool import build_inference_pool
from spyre_operator.settings import OperatorSettings

from tests.conftest import REPO

EXAMPLES = REPO / "examples"


def docs_of(name: str) -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d}


def test_the_inference_pool_example_and_its_route():
    docs = docs_of("inference-pool.yaml")
    m = {**docs["SpyreModel"], "metadata": {**docs["SpyreModel"]["metadata"], "namespace": "ml", "uid": "u"}}
    settings = OperatorSettings()
    pool = build_inference_pool(m, check_spec(m["metadata"]["name"], m["spec"], settings), settings)
    assert pool["spec"]["endpointPickerRef"]["name"] == "granite-8b-epp"
    (rule,) = docs["HTTPRoute"]["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        pool["metadata"]["name"],
    )
    assert docs["HTTPRoute"]["apiVersion"] == "gateway.networking.k8s.io/v1"


def scaled_model() -> dict:
    return docs_of("inference-pool.yaml")["SpyreModel"]


def test_the_hpa_example_validates_and_drives_the_model_on_its_waiting_requests():
    hpa = docs_of("hpa.yaml")["HorizontalPodAutoscaler"]
    for version in ("1.25.0", kubernetes_validate.latest_version()):
        kubernetes_validate.validate(hpa, version, strict=True)
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        "spyre-serve.io/v1alpha1",
        "SpyreModel",
        scaled_model()["metadata"]["name"],
    )
    assert [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]] == ["vllm:num_requests_waiting"]


# KEDA's ScaledObject (keda.sh/v1alpha1) as its documentation describes the fields, with the prometheus
# scaler's parameters; unknown fields are refused: a misspelt field fails here (KEDA's CRD would drop it).
_INT = {"type": "integer", "minimum": 0}
_STR = {"type": "string", "minLength": 1}
PROMETHEUS_METADATA = {
    "type": "object",
    "required": ["serverAddress", "query", "threshold"],
    "additionalProperties": False,
    "properties": {
        **{
            k: _STR
            for k in (
                "serverAddress",
                "query",
                "queryParameters",
                "namespace",
                "customHeaders",
                "ignoreNullValues",
                "unsafeSsl",
                "authModes",
            )
        },
        "threshold": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
        "activationThreshold": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
    },
}
SCALED_OBJECT = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {k: _STR for k in ("apiVersion", "kind", "name", "envSourceContainerName")},
                },
                **{
                    k: _INT
                    for k in (
                        "pollingInterval",
                        "cooldownPeriod",
                        "initialCooldownPeriod",
                        "idleReplicaCount",
                        "minReplicaCount",
                        "maxReplicaCount",
                    )
                },
                "fallback": {
                    "type": "object",
                    "required": ["failureThreshold", "replicas"],
                    "properties": {"failureThreshold": _INT, "replicas": _INT},
                },
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"name": _STR, "behavior": {"type": "object"}},
                        },
                        "scalingModifiers": {"type": "object", "required": ["target", "formula"]},
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": _STR,
                            "name": _STR,
                            "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                            "authenticationRef": {"type": "object", "required": ["name"]},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                        },
                        "if": {"properties": {"type": {"const": "prometheus"}}},
                        "then": {"properties": {"metadata": PROMETHEUS_METADATA}},
                    },
                },
            },
        },
    },
}


def test_the_keda_example_matches_kedas_documented_fields_and_scales_to_zero_on_waiting_requests():
    scaled = docs_of("keda-scaledobject.yaml")["ScaledObject"]
    jsonschema.validate(scaled, SCALED_OBJECT)
    spec = scaled["spec"]
    # the HPA part KEDA makes takes the behavior as an HPA's own: the published schema checks it
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    hpa = docs_of("hpa.yaml")["HorizontalPodAutoscaler"]
    kubernetes_validate.validate(
        {**hpa, "spec": {**hpa["spec"], "behavior": behavior}}, "1.25.0", strict=True
    )
    served = scaled_model()["spec"]["model"]["servedModelName"]
    target = spec["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        "spyre-serve.io/v1alpha1",
        "SpyreModel",
        scaled_model()["metadata"]["name"],
    )
    assert spec["minReplicaCount"] == 0 < spec["maxReplicaCount"]
    queries = {t["name"]: t["metadata"]["query"] for t in spec["triggers"] if t["type"] == "prometheus"}
    assert re.fullmatch(rf'sum\(vllm:num_requests_waiting\{{model_name="{served}"\}}\)', queries["waiting"])
    assert all(f'model_name="{served}"' in q for q in queries.values())
    # the schema is not a rubber stamp: a misspelt field or a trigger without its query fails
    for broken in (
        {**scaled, "spec": {**spec, "minReplicas": 0}},
        {**scaled, "spec": {**spec, "triggers": [{"type": "prometheus", "metadata": {"threshold": "4"}}]}},
        {**scaled, "spec": {**spec, "scaleTargetRef": {"kind": "SpyreModel"}}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, SCALED_OBJECT)
