"""What a gateway in front of the model reads: the model's InferencePool (the Gateway API Inference Extension,
inference.networking.k8s.io/v1), through which a gateway routes requests by asking an endpoint picker which
pod should serve each one. Whether a model wants a pool (spec.inferencePool, else the operator's setting), the
rule only the operator's settings can check (the pool's port is the runtime's), and the pure builder and drift
check. The pool selects exactly the model's serving pods (never its compile Job's) on the runtime's port; the
pods carry llm-d's engine-type label, which tells the picker that they speak vLLM's metric names."""

from __future__ import annotations

from spyre_operator.manifests import owner_reference, selector_labels
from spyre_operator.model_spec import InvalidSpec, ModelSpec
from spyre_operator.settings import (
    COMPONENT_LABEL,
    MANAGED_BY,
    MODEL_LABEL,
    POOL_GROUP,
    POOL_VERSION,
    OperatorSettings,
)

KIND = "InferencePool"
# what the operator owns of a pool's spec, and what the API server fills in when a field is left out
OWNED_FIELDS = ("selector", "targetPorts", "appProtocol", "endpointPickerRef")
PICKER_DEFAULTS = {"group": "", "kind": "Service", "failureMode": "FailClose"}


def wants_pool(spec: ModelSpec, settings: OperatorSettings) -> bool:
    enabled = spec.inference_pool.enabled
    return settings.inference_pool if enabled is None else enabled


def check_inference_pool(spec: ModelSpec, settings: OperatorSettings) -> None:
    """The pool's port must be one the model's pods serve: the runtime's (by number or by its name)."""
    port = spec.inference_pool.target_port
    if port is not None and port not in (settings.runtime_port, "http"):
        raise InvalidSpec(
            "inferencePool.targetPort",
            f"{port!r} is not a port of the model's pods: the runtime serves on {settings.runtime_port} "
            "(named http)",
        )


def pool_selector(name: str) -> dict[str, str]:
    """The model's serving pods: its compile Job's pods carry neither label."""
    return {**selector_labels(name), COMPONENT_LABEL: "inference"}


def picker_name(name: str) -> str:
    """The endpoint picker's Service when the spec names none: what the Gateway API Inference Extension's
    chart calls the picker it deploys for a pool of the model's name."""
    return f"{name[:40]}-epp"


def build_inference_pool(model: dict, spec: ModelSpec, settings: OperatorSettings) -> dict | None:
    """The model's InferencePool, named after the model and owned by it; None when the model wants none.
    The fields the API server would default are written out, but for the picker's core group (""), which is
    left to the default (Kubernetes 1.20 reads an empty string as null)."""
    if not wants_pool(spec, settings):
        return None
    name = model["metadata"]["name"]
    picker = spec.inference_pool.picker
    ref = {"kind": picker.kind, "name": picker.name or picker_name(name), "failureMode": picker.failure_mode}
    if picker.group:
        ref = {"group": picker.group, **ref}
    if picker.port is not None:
        ref["port"] = {"number": picker.port}
    return {
        "apiVersion": f"{POOL_GROUP}/{POOL_VERSION}",
        "kind": KIND,
        "metadata": {
            "name": name,
            "namespace": model["metadata"]["namespace"],
            "labels": {MODEL_LABEL: name, **MANAGED_BY},
            "ownerReferences": [owner_reference(model)],
        },
        "spec": {
            "selector": {"matchLabels": pool_selector(name)},
            "targetPorts": [{"number": settings.runtime_port}],
            "appProtocol": spec.inference_pool.app_protocol,
            "endpointPickerRef": ref,
        },
    }


def pool_repair(have: dict, want: dict) -> list[dict] | None:
    """The JSON patch restoring what the operator owns of the pool's spec to `want`'s (a whole field at a
    time, so a label or port someone added goes too); None when intact. Fields left to the API server's
    defaults compare by those defaults (an older CRD without appProtocol stores none)."""
    ops = [
        {"op": "add", "path": f"/spec/{field}", "value": want["spec"][field]}
        for field in OWNED_FIELDS
        if _as_served(have, field) != _as_served(want, field)
    ]
    return ops or None


def _as_served(pool: dict, field: str):
    value = (pool.get("spec") or {}).get(field)
    if field == "appProtocol":
        return value or "http"
    if field == "endpointPickerRef":
        return {**PICKER_DEFAULTS, **(value or {})}
    return value


def describe(pool: dict) -> str:
    """One line for the condition: which pods, which port, which picker."""
    spec = pool["spec"]
    ref = spec["endpointPickerRef"]
    labels = ",".join(f"{k}={v}" for k, v in spec["selector"]["matchLabels"].items())
    port = f":{ref['port']['number']}" if "port" in ref else ""
    return (
        f"InferencePool {pool['metadata']['name']} selects the pods {labels} on port "
        f"{spec['targetPorts'][0]['number']} ({spec['appProtocol']}); endpoint picker {ref['kind']} "
        f"{ref['name']}{port} ({ref['failureMode']})"
    )
