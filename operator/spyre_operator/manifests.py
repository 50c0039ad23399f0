"""Pure builders: (SpyreModel, spec, settings) -> Kubernetes objects as dicts. Deterministic, no I/O."""

from __future__ import annotations

import hashlib
import json

from spyre_operator import placement
from spyre_operator.model_spec import ModelSpec
from spyre_operator.model_volumes import CACHE_VOLUME, CONTAINER_SECURITY, model_storage
from spyre_operator.runtime_contract import CACHE_MOUNT, engine_args, runtime_args, runtime_env
from spyre_operator.settings import (
    ATTEMPT_ANNOTATION,
    CACHE_KEY_LABEL,
    COMPILE_LABEL,
    COMPONENT_LABEL,
    ENGINE_TYPE_LABEL,
    GROUP,
    HASH_LABEL,
    KIND,
    MANAGED_BY,
    MODEL_LABEL,
    SPEC_LABEL,
    VERSION,
    OperatorSettings,
)

PROBE_PERIOD = 10


def owner_reference(model: dict) -> dict:
    meta = model["metadata"]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def is_owned_by(obj: dict, model: dict) -> bool:
    uid = model["metadata"]["uid"]
    return any(r.get("uid") == uid for r in obj["metadata"].get("ownerReferences") or [])


def selector_labels(name: str) -> dict[str, str]:
    return {MODEL_LABEL: name}


def cache_claim_name(name: str, spec: ModelSpec) -> str | None:
    if not spec.cache.enabled:
        return None
    return spec.cache.existing_claim or f"{name}-graph-cache"


def _num_doublings(start: int, top: int) -> int:
    """How many of start, 2*start, 4*start, ... are needed to reach top (the runtime's bucket menus)."""
    return ((max(top, start) - 1) // start).bit_length() + 1


def startup_failure_threshold(spec: ModelSpec, settings: OperatorSettings) -> int:
    """Budget of the startup probe: every shape (prefill and decode graphs) may take the per-shape time.
    Continuous batching compiles a chunk bucket per prefill size and a decode graph per (batch, KV length)
    bucket: counted here as pairs of graphs."""
    if spec.mode == "static":
        num_shapes = len(spec.shapes)
    else:
        chunk = spec.max_num_batched_tokens or 256
        chunk_graphs = min(chunk, 256) // 64 + (_num_doublings(256, chunk) - 1 if chunk > 256 else 0)
        graphs = chunk_graphs + _num_doublings(1, spec.max_num_seqs) * _num_doublings(64, spec.max_model_len)
        num_shapes = -(-graphs // 2)
    # graphs loaded from a precompiled cache take a fraction of compiling them
    per_shape = settings.startup_seconds_per_shape // (5 if spec.cache.precompile else 1)
    return max(6, (60 + num_shapes * per_shape) // PROBE_PERIOD)


def _storage(
    name: str, spec: ModelSpec, settings: OperatorSettings, is_serving: bool = True
) -> tuple[list[dict], list[dict], list[dict]]:
    """(volumeMounts, volumes, initContainers): shared memory (sized for tensor-parallel serving pods), /tmp,
    the model (model_volumes.py: by source scheme) and the graph cache."""
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "tmp", "mountPath": "/tmp"}]
    shm = {"medium": "Memory"}
    if spec.cards > 1 and is_serving:  # ranks exchange tensors through shared memory
        shm["sizeLimit"] = settings.shm_size
    volumes = [
        {"name": "dshm", "emptyDir": shm},
        {"name": "tmp", "emptyDir": {}},
    ]
    model_mounts, model_volumes, init = model_storage(spec, settings)
    mounts += model_mounts
    volumes += model_volumes
    claim = cache_claim_name(name, spec)
    if claim:
        mounts.append({"name": CACHE_VOLUME, "mountPath": CACHE_MOUNT})
        volumes.append({"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": claim}})
    return mounts, volumes, init


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


def pod_template(name: str, spec: ModelSpec, settings: OperatorSettings) -> dict:
    """The pod spec every replica shares; its hash detects drift."""
    port = settings.runtime_port
    probe = {"httpGet": {"path": "/health", "port": port}}
    resources = {k: dict(v) for k, v in spec.resources.items() if k in ("requests", "limits")}
    claims = placement.request_cards(resources, name, spec, settings)
    mounts, volumes, init = _storage(name, spec, settings)
    container = {
        "name": "runtime",
        "image": spec.image or settings.runtime_image,
        "command": ["spyre-runtime"],
        "args": runtime_args(spec, settings),
        "env": runtime_env(spec),
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "resources": resources,
        "volumeMounts": mounts,
        "startupProbe": {
            **probe,
            "periodSeconds": PROBE_PERIOD,
            "failureThreshold": startup_failure_threshold(spec, settings),
        },
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 2},
        # the runtime's one-line start-up error reaches the pod's status (and the model's condition)
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 3},
        "securityContext": dict(CONTAINER_SECURITY),
    }
    pod_spec = {
        **({"initContainers": init} if init else {}),
        "containers": [container],
        "volumes": volumes,
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 60,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security(settings),
    }
    if claims:
        pod_spec["resourceClaims"] = claims
    _placement(pod_spec, spec, settings)
    return pod_spec


def _placement(pod_spec: dict, spec: ModelSpec, settings: OperatorSettings) -> None:
    scheduler = spec.scheduler_name or settings.scheduler_name
    if scheduler:
        pod_spec["schedulerName"] = scheduler
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.tolerations]
    if spec.affinity:
        pod_spec["affinity"] = spec.affinity
    if spec.priority_class_name:
        pod_spec["priorityClassName"] = spec.priority_class_name


def spec_hash(model: dict) -> str:
    """The model's spec as far as it shapes pods (replicas, suspend, the rollout budget and the InferencePool
    aside): pods whose template changed but whose spec hash did not were changed by the operator's own
    settings."""
    aside = ("replicas", "suspend", "rollout", "inferencePool")
    spec = {k: v for k, v in (model.get("spec") or {}).items() if k not in aside}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]


def template_hash(pod_spec: dict) -> str:
    return hashlib.sha256(json.dumps(pod_spec, sort_keys=True).encode()).hexdigest()[:10]


def build_pod(model: dict, spec: ModelSpec, settings: OperatorSettings) -> dict:
    """The API server completes the name (generateName): `<model>-<template hash>-<random>`."""
    name = model["metadata"]["name"]
    pod_spec = pod_template(name, spec, settings)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": f"{name}-{template_hash(pod_spec)}-",
            "namespace": model["metadata"]["namespace"],
            "labels": {
                **selector_labels(name),
                HASH_LABEL: template_hash(pod_spec),
                SPEC_LABEL: spec_hash(model),
                COMPONENT_LABEL: "inference",
                **ENGINE_TYPE_LABEL,
                **MANAGED_BY,
            },
            "ownerReferences": [owner_reference(model)],
            **(
                {
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(settings.runtime_port),
                        "prometheus.io/path": "/metrics",
                    }
                }
                if settings.prometheus_annotations
                else {}
            ),
        },
        "spec": pod_spec,
    }


def clone_pod(pod: dict) -> dict:
    """A new pod like `pod` (a replica of a template the current spec no longer produces: it keeps an
    older rollout's pods whole while the new one waits, e.g. for its compile Job)."""
    meta = pod["metadata"]
    spec = {k: v for k, v in pod["spec"].items() if k != "nodeName"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": meta.get("generateName") or meta["name"].rsplit("-", 1)[0] + "-",
            "namespace": meta["namespace"],
            "labels": dict(meta.get("labels") or {}),
            "ownerReferences": list(meta.get("ownerReferences") or []),
        },
        "spec": spec,
    }


def build_service(model: dict, settings: OperatorSettings) -> dict:
    name = model["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": model["metadata"]["namespace"],
            "labels": {**selector_labels(name), **MANAGED_BY},
            "ownerReferences": [owner_reference(model)],
        },
        "spec": {
            "selector": selector_labels(name),
            "ports": [
                {"name": "http", "port": settings.runtime_port, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }


def build_claim_template(model: dict, spec: ModelSpec) -> dict | None:
    """The ResourceClaimTemplate of a model whose cards come by DRA (spec.devices); None otherwise."""
    if spec.devices is None:
        return None
    name = model["metadata"]["name"]
    meta = {
        "namespace": model["metadata"]["namespace"],
        "labels": {**selector_labels(name), **MANAGED_BY},
        "ownerReferences": [owner_reference(model)],
    }
    return placement.claim_template(name, spec, meta)


def build_cache_claim(model: dict, spec: ModelSpec, settings: OperatorSettings) -> dict | None:
    """One claim per model, shared by all replicas. None when disabled or an existing claim is used.
    With retention Delete the claim is owned by the model (garbage-collected with it); Retain keeps it."""
    if not spec.cache.enabled or spec.cache.existing_claim:
        return None
    name = model["metadata"]["name"]
    meta = {
        "name": cache_claim_name(name, spec),
        "namespace": model["metadata"]["namespace"],
        "labels": {**selector_labels(name), **MANAGED_BY},
    }
    if spec.cache.retention == "Delete":
        meta["ownerReferences"] = [owner_reference(model)]
    claim_spec = {
        "accessModes": [spec.cache.access_mode],
        "resources": {"requests": {"storage": spec.cache.size}},
    }
    storage_class = spec.cache.storage_class or settings.default_storage_class
    if storage_class:
        claim_spec["storageClassName"] = storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": claim_spec}


# ---- precompile ----------------------------------------------------------------------------------


def cache_key(spec: ModelSpec, settings: OperatorSettings) -> str:
    """Names one compile configuration: what the graphs depend on as far as the operator can see (the
    model source, backend, shapes or limits, cards, runtime image and user environment). The runtime keys
    its entries finer still (weights digest, library versions)."""
    config = {
        "source": spec.source,
        "backend": spec.backend,
        "mode": spec.mode,
        "shapes": [[s.prompt_length, s.new_tokens, s.batch_size] for s in spec.shapes]
        if spec.mode == "static"
        else None,
        "engine": engine_args(spec),
        "image": spec.image or settings.runtime_image,
        "env": list(spec.env),
    }
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def compile_job_name(name: str, key: str) -> str:
    return f"{name[:40]}-compile-{key[:10]}"


def build_compile_job(
    model: dict, spec: ModelSpec, settings: OperatorSettings, key: str, attempt: int = 1
) -> dict:
    """A Job that runs `spyre-runtime compile` into the shared cache. It requests no cards: inductor
    compiles on CPU and sendnn uses its card-less compile-only backend."""
    name = model["metadata"]["name"]
    mounts, volumes, init = _storage(name, spec, settings, is_serving=False)
    resources = {k: dict(v) for k, v in spec.resources.items() if k in ("requests", "limits")}
    labels = {COMPILE_LABEL: name, CACHE_KEY_LABEL: key, COMPONENT_LABEL: "compile", **MANAGED_BY}
    container = {
        "name": "compile",
        "image": spec.image or settings.runtime_image,
        "command": ["spyre-runtime"],
        "args": ["compile", spec.model_path_in_pod, *engine_args(spec)],
        "env": runtime_env(spec, serving=False),
        "resources": resources,
        "volumeMounts": mounts,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": dict(CONTAINER_SECURITY),
    }
    pod_spec = {
        **({"initContainers": init} if init else {}),
        "containers": [container],
        "volumes": volumes,
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security(settings),
    }
    _placement(pod_spec, spec, settings)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": compile_job_name(name, key),
            "namespace": model["metadata"]["namespace"],
            "labels": labels,
            "annotations": {ATTEMPT_ANNOTATION: str(attempt)},
            "ownerReferences": [owner_reference(model)],
        },
        "spec": {
            "backoffLimit": 1,
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }
