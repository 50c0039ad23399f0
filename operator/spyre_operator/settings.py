"""Operator settings: parsed once from the environment and flags, validated, frozen."""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from spyre_contract.image_reference import image_reference_error
from spyre_contract.tracing import endpoint_error, traces_url

GROUP = "spyre-serve.io"
VERSION = "v1alpha1"
PLURAL = "spyremodels"
KIND = "SpyreModel"

MODEL_LABEL = f"{GROUP}/model"
HASH_LABEL = f"{GROUP}/template-hash"
COMPILE_LABEL = f"{GROUP}/compile-for"  # on compile Jobs and their pods (not MODEL_LABEL: not replicas)
CACHE_KEY_LABEL = f"{GROUP}/cache-key"
SPEC_LABEL = f"{GROUP}/spec-hash"  # on pods: the model spec they were made for (operator settings aside)
ATTEMPT_ANNOTATION = f"{GROUP}/attempt"  # on compile Jobs: which attempt of the current cache key
FETCH_LABEL = f"{GROUP}/fetch-for"  # on loader Jobs and their pods (not MODEL_LABEL: not replicas)
PROGRESS_ANNOTATION = (
    f"{GROUP}/model-progress"  # on a loader pod: "<done>/<total>" bytes, written by the loader
)
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY = {"app.kubernetes.io/managed-by": "spyre-operator"}
# on serving pods: tells llm-d's endpoint picker which metric names they speak (the runtime exports vLLM's)
ENGINE_TYPE_LABEL = {"llm-d.ai/engine-type": "vllm"}
# the Gateway API Inference Extension's InferencePool: one per model that asks for it (spec.inferencePool)
POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
POOL_PLURAL = "inferencepools"
# prometheus-operator's PodMonitor: one per model when the cluster serves the API (kinds/pod_monitor.py)
MONITOR_GROUP = "monitoring.coreos.com"
MONITOR_VERSION = "v1"
MONITOR_PLURAL = "podmonitors"
RESOURCE_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[a-z0-9A-Z_.-]+$"
)


class SettingsError(ValueError):
    """A bad operator setting; the message names the variable or flag."""


@dataclass(frozen=True)
class OperatorSettings:
    card_resource: str = "ibm.com/spyre_pf"
    scheduler_name: str | None = None
    runtime_image: str = "quay.io/spyre-serve/runtime:0.1.0"
    default_storage_class: str | None = None
    namespaces: tuple[str, ...] = ()  # empty: all namespaces
    resync_seconds: float = 30.0
    startup_seconds_per_shape: int = 600  # the startup probe's budget for compiling one shape
    runtime_port: int = 8000
    api_timeout_seconds: float = 30.0  # every API call
    stuck_grace_seconds: float = 120.0  # image never pulls / container config missing: then replaced
    start_grace_seconds: float = 300.0  # a pod bound to a node whose containers have not started: reported
    compile_attempts: int = 3  # compile Job attempts per cache key before the model is Stalled
    compile_retry_seconds: float = 30.0  # back-off before the 2nd attempt, doubling after
    workers: int = 8  # reconcile workers (one key at a time each; they wait on the API server, not the CPU)
    leader_election: bool = True  # act only while holding the Lease (replicas > 1 are standbys)
    lease_namespace: str = "spyre-system"  # default: POD_NAMESPACE when set
    lease_name: str = "spyre-operator"
    lease_seconds: float = 15.0
    health_host: str = "0.0.0.0"
    health_port: int = 8080  # /healthz, /readyz, /metrics; 0: off
    run_as_user: int | None = None  # inference pods: a fixed user only when set (OpenShift assigns one)
    fs_group: int | None = None
    prometheus_annotations: bool = False  # prometheus.io/scrape annotations on inference pods
    max_concurrent_rollouts: int = 2  # models rolling out a change of these settings at once
    card_tiers: tuple[int, ...] = ()  # e.g. (4, 8, 16): <card_resource>_tier0.. hold that many linked cards
    shm_size: str = "8Gi"  # /dev/shm (memory) of tensor-parallel pods
    card_memory_gib: float = 128.0  # a Spyre card's memory, for the memory plan
    require_known_config: bool = False  # refuse models not in the known-configurations registry
    inference_pool: bool = False  # an InferencePool per model whose spec.inferencePool does not say otherwise
    oci_mode: str = (
        "modelcar"  # oci:// models: "modelcar" (an init container copies the files) or "image-volume"
    )
    allow_host_path: bool = False  # file:// models (a hostPath on the node): an admin's choice
    # spec.tls on OpenShift: the service CA writes the Secret named by the Service's annotation
    openshift_service_ca: bool = False
    loader_retries: int = (
        2  # the loader Job's backoffLimit: transient failures retried with Kubernetes' back-off
    )
    pod_monitors: bool = True  # a PodMonitor per model when prometheus-operator's API is served
    pod_monitor_interval: str = "15s"
    pod_monitor_labels: tuple[tuple[str, str], ...] = ()  # e.g. (("release", "kube-prometheus-stack"),)
    otlp_traces_endpoint: str | None = None  # request traces of models whose spec.tracing does not say
    network_policy: bool = False  # a NetworkPolicy per model (kinds/network_policy.py)
    monitoring_namespace: str | None = None  # its scrapers reach the pods' metrics through that policy


ENV = {
    "card_resource": "SPYRE_OPERATOR_CARD_RESOURCE",
    "scheduler_name": "SPYRE_OPERATOR_SCHEDULER_NAME",
    "runtime_image": "SPYRE_OPERATOR_RUNTIME_IMAGE",
    "default_storage_class": "SPYRE_OPERATOR_DEFAULT_STORAGE_CLASS",
    "namespaces": "SPYRE_OPERATOR_NAMESPACES",
    "resync_seconds": "SPYRE_OPERATOR_RESYNC_SECONDS",
    "startup_seconds_per_shape": "SPYRE_OPERATOR_STARTUP_SECONDS_PER_SHAPE",
    "api_timeout_seconds": "SPYRE_OPERATOR_API_TIMEOUT_SECONDS",
    "stuck_grace_seconds": "SPYRE_OPERATOR_STUCK_GRACE_SECONDS",
    "start_grace_seconds": "SPYRE_OPERATOR_START_GRACE_SECONDS",
    "compile_attempts": "SPYRE_OPERATOR_COMPILE_ATTEMPTS",
    "compile_retry_seconds": "SPYRE_OPERATOR_COMPILE_RETRY_SECONDS",
    "workers": "SPYRE_OPERATOR_WORKERS",
    "leader_election": "SPYRE_OPERATOR_LEADER_ELECTION",
    "lease_namespace": "SPYRE_OPERATOR_LEASE_NAMESPACE",
    "lease_name": "SPYRE_OPERATOR_LEASE_NAME",
    "lease_seconds": "SPYRE_OPERATOR_LEASE_SECONDS",
    "health_host": "SPYRE_OPERATOR_HEALTH_HOST",
    "health_port": "SPYRE_OPERATOR_HEALTH_PORT",
    "run_as_user": "SPYRE_OPERATOR_RUN_AS_USER",
    "fs_group": "SPYRE_OPERATOR_FS_GROUP",
    "prometheus_annotations": "SPYRE_OPERATOR_PROMETHEUS_ANNOTATIONS",
    "max_concurrent_rollouts": "SPYRE_OPERATOR_MAX_CONCURRENT_ROLLOUTS",
    "card_tiers": "SPYRE_OPERATOR_CARD_TIERS",
    "shm_size": "SPYRE_OPERATOR_SHM_SIZE",
    "card_memory_gib": "SPYRE_OPERATOR_CARD_MEMORY_GIB",
    "require_known_config": "SPYRE_OPERATOR_REQUIRE_KNOWN_CONFIG",
    "inference_pool": "SPYRE_OPERATOR_INFERENCE_POOL",
    "oci_mode": "SPYRE_OPERATOR_OCI_MODE",
    "allow_host_path": "SPYRE_OPERATOR_ALLOW_HOST_PATH",
    "openshift_service_ca": "SPYRE_OPERATOR_OPENSHIFT_SERVICE_CA",
    "loader_retries": "SPYRE_OPERATOR_LOADER_RETRIES",
    "pod_monitors": "SPYRE_OPERATOR_POD_MONITORS",
    "pod_monitor_interval": "SPYRE_OPERATOR_POD_MONITOR_INTERVAL",
    "pod_monitor_labels": "SPYRE_OPERATOR_POD_MONITOR_LABELS",
    "otlp_traces_endpoint": "SPYRE_OPERATOR_OTLP_TRACES_ENDPOINT",
    "network_policy": "SPYRE_OPERATOR_NETWORK_POLICY",
    "monitoring_namespace": "SPYRE_OPERATOR_MONITORING_NAMESPACE",
}
OCI_MODES = ("modelcar", "image-volume")

# every container the operator makes (runtime, compile, loader, modelcar) runs so
CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "readOnlyRootFilesystem": True,  # the runtime writes only to /tmp, /dev/shm and the cache volume
}


def pod_security(settings: OperatorSettings) -> dict:
    """No fixed user or group unless the settings ask for one: OpenShift's restricted SCC assigns them."""
    security = {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
        "fsGroupChangePolicy": "OnRootMismatch",  # no recursive chown of a large graph cache at each start
    }
    if settings.run_as_user is not None:
        security["runAsUser"] = settings.run_as_user
    if settings.fs_group is not None:
        security["fsGroup"] = settings.fs_group
    return security


def add_flags(parser: argparse.ArgumentParser) -> None:
    for field, var in ENV.items():
        parser.add_argument("--" + field.replace("_", "-"), default=None, help=f"(env {var})")


def load_settings(
    environ: Mapping[str, str] | None = None, flags: argparse.Namespace | None = None
) -> OperatorSettings:
    """Environment first; a flag that is given wins. Each value is parsed by its field's rule (PARSE), in
    PARSE's order, so the first bad setting is the one reported."""
    env = os.environ if environ is None else environ
    given: dict[str, tuple[str, str]] = {}  # field -> (value, where it came from)
    for field, var in ENV.items():
        value = getattr(flags, field, None) if flags is not None else None
        source = f"--{field.replace('_', '-')}"
        if value is None and env.get(var):
            value, source = env[var], var
        if value is not None:
            given[field] = (value, source)
    if "lease_namespace" not in given:
        given["lease_namespace"] = (env.get("POD_NAMESPACE") or "", "POD_NAMESPACE")
    values = {}
    for field, parse in PARSE.items():
        if field in given:
            parsed = parse(*given[field])
            if parsed is not None:
                values[field] = parsed
    return OperatorSettings(**values)


# ---- one rule per kind of value: (value, where it came from) -> the setting, or None for the default --


def _text(value: str, source: str) -> str:
    return value


def _non_empty(value: str, source: str) -> str | None:
    return value or None


def _resource_name(value: str, source: str) -> str:
    if not RESOURCE_NAME.match(value) or "/" not in value:
        raise SettingsError(f"{source}={value!r} is not an extended resource name like ibm.com/spyre_pf")
    return value


def _image(value: str, source: str) -> str:
    if error := image_reference_error(value):
        raise SettingsError(f"{source}={value!r} is not an image reference a kubelet can pull: {error}")
    return value


def _boolean(value: str, source: str) -> bool:
    if value.strip().lower() not in ("1", "0", "true", "false", "on", "off"):
        raise SettingsError(f"{source}={value!r} is not a boolean (use 1 or 0)")
    return value.strip().lower() in ("1", "true", "on")


def _oci_mode(value: str, source: str) -> str:
    if value not in OCI_MODES:
        raise SettingsError(f"{source}={value!r} must be one of {', '.join(OCI_MODES)}")
    return value


def _count(value: str, source: str) -> int:
    if not value.strip().isdigit():
        raise SettingsError(f"{source}={value!r} is not a count (0 or more)")
    return int(value)


def _card_tiers(value: str, source: str) -> tuple[int, ...]:
    try:
        tiers = tuple(int(t) for t in value.split(",") if t.strip())
    except ValueError:
        raise SettingsError(f"{source}={value!r} is not a comma list of card counts like 4,8,16") from None
    if not tiers or any(t <= 0 for t in tiers) or list(tiers) != sorted(set(tiers)):
        raise SettingsError(f"{source}={value!r} must list increasing positive card counts like 4,8,16")
    return tiers


def _memory_size(value: str, source: str) -> str:
    if not re.match(r"^[0-9]+(Ki|Mi|Gi|Ti)$", value):
        raise SettingsError(f"{source}={value!r} is not a size like 8Gi")
    return value


def _id(value: str, source: str) -> int:
    if not value.strip().isdigit():
        raise SettingsError(f"{source}={value!r} is not a user or group id")
    return int(value)


def _port(value: str, source: str) -> int:
    if not value.isdigit() or int(value) > 65535:
        raise SettingsError(f"{source}={value!r} is not a port (0 turns the endpoint off)")
    return int(value)


def _duration(value: str, source: str) -> str:
    if not re.match(r"^[0-9]+(ms|s|m|h)$", value):
        raise SettingsError(f"{source}={value!r} is not a Prometheus duration like 15s")
    return value


def _labels(value: str, source: str) -> tuple[tuple[str, str], ...]:
    try:
        labels = json.loads(value or "{}")
    except ValueError:
        labels = None
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        raise SettingsError(
            f'{source}={value!r} is not a JSON object of label values like {{"release": "x"}}'
        )
    return tuple(sorted(labels.items()))


def _otlp_endpoint(value: str, source: str) -> str | None:
    if not value.strip():
        return None
    if error := endpoint_error(value):
        raise SettingsError(f"{source}: {error}")
    return traces_url(value)


def _namespace(value: str, source: str) -> str | None:
    if len(value) > 63 or (value and not re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", value)):
        raise SettingsError(f"{source}={value!r} is not a namespace name (a DNS label)")
    return value or None


def _names(value: str, source: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in value.split(",") if n.strip())


def _positive(cast: type) -> Callable[[str, str], float | int]:
    def parse(value: str, source: str) -> float | int:
        try:
            parsed = cast(value)
        except ValueError:
            raise SettingsError(f"{source}={value!r} is not a number") from None
        if parsed <= 0:
            raise SettingsError(f"{source}={value!r} must be positive")
        return parsed

    return parse


PARSE = {
    "card_resource": _resource_name,
    "scheduler_name": _text,
    "runtime_image": _image,
    "default_storage_class": _text,
    "lease_name": _text,
    "health_host": _text,
    "lease_namespace": _non_empty,  # default: POD_NAMESPACE, else spyre-system
    "leader_election": _boolean,
    "prometheus_annotations": _boolean,
    "require_known_config": _boolean,
    "inference_pool": _boolean,
    "allow_host_path": _boolean,
    "network_policy": _boolean,
    "monitoring_namespace": _namespace,
    "openshift_service_ca": _boolean,
    "oci_mode": _oci_mode,
    "loader_retries": _count,
    "pod_monitors": _boolean,
    "pod_monitor_interval": _duration,
    "pod_monitor_labels": _labels,
    "otlp_traces_endpoint": _otlp_endpoint,
    "card_tiers": _card_tiers,
    "shm_size": _memory_size,
    "run_as_user": _id,
    "fs_group": _id,
    "health_port": _port,
    "namespaces": _names,
    "resync_seconds": _positive(float),
    "startup_seconds_per_shape": _positive(int),
    "api_timeout_seconds": _positive(float),
    "stuck_grace_seconds": _positive(float),
    "start_grace_seconds": _positive(float),
    "compile_attempts": _positive(int),
    "compile_retry_seconds": _positive(float),
    "workers": _positive(int),
    "lease_seconds": _positive(float),
    "max_concurrent_rollouts": _positive(int),
    "card_memory_gib": _positive(float),
}
