"""Operator settings: parsed once from the environment and flags, validated, frozen."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

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
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY = {"app.kubernetes.io/managed-by": "spyre-operator"}
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
}


def add_flags(parser: argparse.ArgumentParser) -> None:
    for field, var in ENV.items():
        parser.add_argument("--" + field.replace("_", "-"), default=None, help=f"(env {var})")


def load_settings(
    environ: Mapping[str, str] | None = None, flags: argparse.Namespace | None = None
) -> OperatorSettings:
    """Environment first; a flag that is given wins."""
    env = os.environ if environ is None else environ
    raw: dict[str, str] = {}
    for field, var in ENV.items():
        value = getattr(flags, field, None) if flags is not None else None
        source = f"--{field.replace('_', '-')}"
        if value is None and env.get(var):
            value, source = env[var], var
        if value is not None:
            raw[field] = (value, source)
    values: dict = {}
    if "card_resource" in raw:
        value, source = raw["card_resource"]
        if not RESOURCE_NAME.match(value) or "/" not in value:
            raise SettingsError(f"{source}={value!r} is not an extended resource name like ibm.com/spyre_pf")
        values["card_resource"] = value
    for field in ("scheduler_name", "runtime_image", "default_storage_class", "lease_name", "health_host"):
        if field in raw:
            values[field] = raw[field][0]
    namespace = raw.get("lease_namespace", (env.get("POD_NAMESPACE") or "", ""))[0]
    if namespace:
        values["lease_namespace"] = namespace
    for field in ("leader_election", "prometheus_annotations", "require_known_config"):
        if field in raw:
            value, source = raw[field]
            if value.strip().lower() not in ("1", "0", "true", "false", "on", "off"):
                raise SettingsError(f"{source}={value!r} is not a boolean (use 1 or 0)")
            values[field] = value.strip().lower() in ("1", "true", "on")
    if "card_tiers" in raw:
        value, source = raw["card_tiers"]
        try:
            tiers = tuple(int(t) for t in value.split(",") if t.strip())
        except ValueError:
            raise SettingsError(
                f"{source}={value!r} is not a comma list of card counts like 4,8,16"
            ) from None
        if not tiers or any(t <= 0 for t in tiers) or list(tiers) != sorted(set(tiers)):
            raise SettingsError(f"{source}={value!r} must list increasing positive card counts like 4,8,16")
        values["card_tiers"] = tiers
    if "shm_size" in raw:
        value, source = raw["shm_size"]
        if not re.match(r"^[0-9]+(Ki|Mi|Gi|Ti)$", value):
            raise SettingsError(f"{source}={value!r} is not a size like 8Gi")
        values["shm_size"] = value
    for field in ("run_as_user", "fs_group"):
        if field in raw:
            value, source = raw[field]
            if not value.strip().isdigit():
                raise SettingsError(f"{source}={value!r} is not a user or group id")
            values[field] = int(value)
    if "health_port" in raw:
        value, source = raw["health_port"]
        if not value.isdigit() or int(value) > 65535:
            raise SettingsError(f"{source}={value!r} is not a port (0 turns the endpoint off)")
        values["health_port"] = int(value)
    if "namespaces" in raw:
        values["namespaces"] = tuple(n.strip() for n in raw["namespaces"][0].split(",") if n.strip())
    for field, cast in (
        ("resync_seconds", float),
        ("startup_seconds_per_shape", int),
        ("api_timeout_seconds", float),
        ("stuck_grace_seconds", float),
        ("compile_attempts", int),
        ("compile_retry_seconds", float),
        ("workers", int),
        ("lease_seconds", float),
        ("max_concurrent_rollouts", int),
        ("card_memory_gib", float),
    ):
        if field in raw:
            value, source = raw[field]
            try:
                parsed = cast(value)
            except ValueError:
                raise SettingsError(f"{source}={value!r} is not a number") from None
            if parsed <= 0:
                raise SettingsError(f"{source}={value!r} must be positive")
            values[field] = parsed
    return OperatorSettings(**values)
