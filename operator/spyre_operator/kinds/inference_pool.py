"""What a gateway in front of the model reads: the model's InferencePool (the Gateway API Inference Extension,
inference.networking.k8s.io/v1), through which a gateway routes requests by asking an endpoint picker which
pod should serve each one. Whether a model wants a pool (spec.inferencePool, else the operator's setting), the
rule only the operator's settings can check (the pool's port is the runtime's), and the pure builder and drift
check. The pool selects exactly the model's serving pods (never its compile Job's) on the runtime's port; the
pods carry llm-d's engine-type label, which tells the picker that they speak vLLM's metric names.

The step: the pool is made once; what the operator owns of it (selector, target
ports, protocol, endpoint picker) restored when someone changed it; removed when the spec no longer wants it.
A cluster that does not serve the InferencePool API (the Gateway API Inference Extension's CRDs are not
installed) is no error: the model serves through its Service, condition InferencePoolReady says why it has no
pool, one Event says it once, and the API is asked again once per resync period, so the pool is made once the
CRD is installed. A pool of the model's name that the model does not own is for a human to settle."""

from __future__ import annotations

import time
from dataclasses import dataclass

from kubernetes.client.rest import ApiException

from spyre_operator.io.events import EventRecorder
from spyre_operator.io.kube import Kube, problem_of
from spyre_operator.io.watch import Key
from spyre_operator.io.work import Pass, Problem
from spyre_operator.kinds.ownership import is_owned_by, owner_reference, selector_labels
from spyre_operator.settings import (
    COMPONENT_LABEL,
    MANAGED_BY,
    MODEL_LABEL,
    POOL_GROUP,
    POOL_VERSION,
    OperatorSettings,
)
from spyre_operator.spec.model_spec import InvalidSpec, ModelSpec

KIND = "InferencePool"
# what the operator owns of a pool's spec, and what the API server fills in when a field is left out
OWNED_FIELDS = ("selector", "targetPorts", "appProtocol", "endpointPickerRef")
PICKER_DEFAULTS = {"group": "", "kind": "Service", "failureMode": "FailClose"}


@dataclass(frozen=True)
class PoolState:
    """The model's InferencePool as the last check left it: there as specified, or why not (condition
    InferencePoolReady)."""

    is_ready: bool
    reason: str
    message: str


UNAVAILABLE = PoolState(
    False,
    "InferencePoolUnavailable",
    f"this cluster does not serve InferencePools ({POOL_GROUP}/{POOL_VERSION}: install the Gateway API "
    "Inference Extension's CRDs); the model serves through its Service, and its InferencePool is made once "
    "the API is served",
)


class InferencePoolStep:
    def __init__(self, settings: OperatorSettings, kube: Kube, events: EventRecorder) -> None:
        self.settings = settings
        self.kube = kube
        self.events = events
        self._states: dict[Key, PoolState] = {}
        self._unserved_until = 0.0  # (monotonic) the API was not served: not asked again before then

    def state(self, key: Key) -> PoolState | None:
        """What the last check found, for the status; None when the model wants no pool."""
        return self._states.get(key)

    def forget(self, key: Key) -> None:
        self._states.pop(key, None)

    def ensure(self, key: Key, model: dict, spec: ModelSpec, work: Pass, has_pool: bool = True) -> bool:
        """True when settled for the model's generation (its pool as specified, or none wanted and none
        left); False when it must be looked at again (the API not served yet, or a problem in `work`).
        `has_pool` False: the watch has seen no pool of the model, so none is left to remove."""
        want = build_inference_pool(model, spec, self.settings)
        if want is None:
            self._states.pop(key, None)
            return self._remove(model, work) if has_pool else True
        state = None
        if time.monotonic() >= self._unserved_until:
            try:
                state = self._apply(model, want, work)
            except ApiException as e:
                problem = problem_of(KIND, e)
                work.problems.append(problem)
                state = PoolState(False, problem.reason, problem.message)
            if state is None:
                self._unserved_until = time.monotonic() + self.settings.resync_seconds
        if state is None:
            self.events.post(model, "Warning", UNAVAILABLE.reason, UNAVAILABLE.message)  # once per model
            state = UNAVAILABLE
        self._states[key] = state
        return state.is_ready

    def _apply(self, model: dict, want: dict, work: Pass) -> PoolState | None:
        """Makes or repairs the pool; None when the cluster does not serve the API."""
        name, namespace = want["metadata"]["name"], want["metadata"]["namespace"]
        try:
            created = self.kube.create_unless_exists(want)
        except ApiException as e:
            if e.status == 404:  # no such resource: the CRD is not installed
                return None
            raise
        if created:
            self.events.post(model, "Normal", "InferencePoolCreated", describe(want))
            return PoolState(True, "Reconciled", describe(want))
        have = self.kube.read(KIND, name, namespace)
        if have is None:  # removed meanwhile: the next pass makes it
            raise ApiException(status=409, reason="InferencePool was being removed")
        if not is_owned_by(have, model):
            problem = Problem(
                "InferencePoolConflict",
                f"InferencePool {name} exists and is not owned by this SpyreModel: remove it, or set "
                "spec.inferencePool.enabled to false",
            )
            work.problems.append(problem)
            return PoolState(False, problem.reason, problem.message)
        patch = pool_repair(have, want)
        if patch:
            self.kube.patch(KIND, name, namespace, patch)
            fields = ", ".join(op["path"].rsplit("/", 1)[1] for op in patch)
            message = f"InferencePool {name}: {fields} restored"
            self.events.post(model, "Normal", "InferencePoolRepaired", message)
        return PoolState(True, "Reconciled", describe(want))

    def _remove(self, model: dict, work: Pass) -> bool:
        """The model's own pool goes when the spec no longer wants one (a pool it does not own stays)."""
        if time.monotonic() < self._unserved_until:
            return True
        name, namespace = model["metadata"]["name"], model["metadata"]["namespace"]
        try:
            have = self.kube.read(KIND, name, namespace)  # None also when the API is not served
            if have is not None and is_owned_by(have, model):
                self.kube.delete(KIND, name, namespace)
                message = f"InferencePool {name}: spec.inferencePool is off"
                self.events.post(model, "Normal", "InferencePoolDeleted", message)
        except ApiException as e:
            work.problems.append(problem_of(KIND, e))
            return False
        return True


# ---- the builder and its checks -----------------------------------------------------------------


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
