"""The serving pod, built: (SpyreModel, spec, settings) -> the pod as a dict, deterministic, no I/O; its
template hash (which detects drift) and spec hash; and the pod-spec pieces the model's Jobs share with it
(its storage: shared memory, /tmp, the model as its source's scheme says, the graph cache; its placement)."""

from __future__ import annotations

import hashlib
import json

from spyre_contract.auth import (
    API_KEY_ENV,
    AUTH_MODE_ENV,
    AUTH_MODE_KUBERNETES,
    AUTH_MODEL_ENV,
    AUTH_NAMESPACE_ENV,
    TLS_CERT_KEY,
    TLS_CERTFILE_ENV,
    TLS_KEY_KEY,
    TLS_KEYFILE_ENV,
    TLS_MOUNT,
)
from spyre_contract.tracing import SERVICE_NAME_VAR, TRACES_ENDPOINT_VAR

from spyre_operator.kinds.access import account_name
from spyre_operator.kinds.graph_cache_claim import cache_claim_name
from spyre_operator.kinds.ownership import owner_reference, selector_labels
from spyre_operator.settings import (
    COMPONENT_LABEL,
    CONTAINER_SECURITY,
    ENGINE_TYPE_LABEL,
    HASH_LABEL,
    MANAGED_BY,
    SPEC_LABEL,
    OperatorSettings,
    pod_security,
)
from spyre_operator.spec import placement
from spyre_operator.spec.model_source import CACHE_VOLUME
from spyre_operator.spec.model_spec import ModelSpec
from spyre_operator.spec.runtime_contract import CACHE_MOUNT, runtime_args, runtime_env

PROBE_PERIOD = 10
# A deleted pod keeps admitting requests this long before the kubelet sends SIGTERM (and the runtime stops
# admitting and drains): the time the endpoint controllers and every kube-proxy or gateway take to stop
# sending it new requests. Without it a client that follows the ready endpoints (re-read every second, as
# kube-proxy syncs) met 503s and reset connections in a rollout on a real node (tests/test_real_node.py).
# Within terminationGracePeriodSeconds, with the runtime's 30 s drain.
DEREGISTRATION_SECONDS = 5
# the digest of the Secrets the pods read (kinds/access.py): new data, new template hash, a rollout
SECRET_DIGEST_ANNOTATION = "spyre-serve.io/secret-digest"


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


def pod_storage(
    name: str, spec: ModelSpec, settings: OperatorSettings, is_serving: bool = True
) -> tuple[list[dict], list[dict], list[dict]]:
    """(volumeMounts, volumes, initContainers): shared memory (sized for tensor-parallel serving pods), /tmp,
    the model (as its source's scheme says: spec/model_source.py) and the graph cache."""
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "tmp", "mountPath": "/tmp"}]
    shm = {"medium": "Memory"}
    if spec.cards > 1 and is_serving:  # ranks exchange tensors through shared memory
        shm["sizeLimit"] = settings.shm_size
    volumes = [
        {"name": "dshm", "emptyDir": shm},
        {"name": "tmp", "emptyDir": {}},
    ]
    model_mounts, model_volumes, init = spec.source.pod_storage(settings)
    mounts += model_mounts
    volumes += model_volumes
    claim = cache_claim_name(name, spec)
    if claim:
        mounts.append({"name": CACHE_VOLUME, "mountPath": CACHE_MOUNT})
        volumes.append({"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": claim}})
    return mounts, volumes, init


def pod_template(name: str, spec: ModelSpec, settings: OperatorSettings) -> dict:
    """The pod spec every replica shares; its hash detects drift."""
    port = settings.runtime_port
    probe = {"httpGet": {"path": "/health", "port": port, **({"scheme": "HTTPS"} if spec.tls else {})}}
    resources = {k: dict(v) for k, v in spec.resources.items() if k in ("requests", "limits")}
    claims = placement.request_cards(resources, name, spec, settings)
    mounts, volumes, init = pod_storage(name, spec, settings)
    container = {
        "name": "runtime",
        "image": spec.image or settings.runtime_image,
        "command": ["spyre-runtime"],
        "args": runtime_args(spec, settings),
        "env": tracing_env(name, spec, settings) + runtime_env(spec),  # spec.env, later, wins
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}]
        + (
            [{"name": "kv-events", "containerPort": spec.kv_events_port, "protocol": "TCP"}]
            if spec.kv_events_port is not None
            else []
        ),
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
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(DEREGISTRATION_SECONDS)]}}},
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
    access_fields(name, spec, container, pod_spec)
    placement_fields(pod_spec, spec, settings)
    return pod_spec


def tracing_env(name: str, spec: ModelSpec, settings: OperatorSettings) -> list[dict]:
    """Request traces: the model's endpoint, else the operator's; the model's name as the service's."""
    endpoint = spec.tracing_endpoint or settings.otlp_traces_endpoint
    if endpoint is None:
        return []
    return [{"name": TRACES_ENDPOINT_VAR, "value": endpoint}, {"name": SERVICE_NAME_VAR, "value": name}]


def access_fields(name: str, spec: ModelSpec, container: dict, pod_spec: dict) -> None:
    """spec.auth and spec.tls on the serving pod: the API key from its Secret (an env valueFrom, never an
    argument); token authorization's identity (the model's ServiceAccount, its token mounted) and the
    SpyreModel a caller must be allowed to `get`; the key pair mounted read-only, and its paths."""
    env = container["env"]
    if spec.auth.api_key:
        ref = {"name": spec.auth.api_key.secret_name, "key": spec.auth.api_key.key}
        env.append({"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": ref}})
    if spec.auth.kubernetes:
        env += [
            {"name": AUTH_MODE_ENV, "value": AUTH_MODE_KUBERNETES},
            {"name": AUTH_MODEL_ENV, "value": name},
            {"name": AUTH_NAMESPACE_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        ]
        pod_spec["serviceAccountName"] = account_name(name)
        pod_spec["automountServiceAccountToken"] = True
    if spec.tls:
        env += [
            {"name": TLS_CERTFILE_ENV, "value": f"{TLS_MOUNT}/{TLS_CERT_KEY}"},
            {"name": TLS_KEYFILE_ENV, "value": f"{TLS_MOUNT}/{TLS_KEY_KEY}"},
        ]
        container["volumeMounts"].append({"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True})
        pod_spec["volumes"].append({"name": "tls", "secret": {"secretName": spec.tls.secret_name}})


def placement_fields(pod_spec: dict, spec: ModelSpec, settings: OperatorSettings) -> None:
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
    """The model's spec as far as it shapes pods (replicas, suspend, the rollout budget, the InferencePool
    and the NetworkPolicy aside): pods whose template changed but whose spec hash did not were changed by the
    operator's own settings."""
    aside = ("replicas", "suspend", "rollout", "inferencePool", "networkPolicy")
    spec = {k: v for k, v in (model.get("spec") or {}).items() if k not in aside}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]


def template_hash(pod_spec: dict, secret_digest: str = "") -> str:
    """The pod spec's hash, and the digest of the Secrets it reads when there are any."""
    text = json.dumps(pod_spec, sort_keys=True) + (f"\n{secret_digest}" if secret_digest else "")
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def build_pod(model: dict, spec: ModelSpec, settings: OperatorSettings) -> dict:
    """The API server completes the name (generateName): `<model>-<template hash>-<random>`."""
    name = model["metadata"]["name"]
    pod_spec = pod_template(name, spec, settings)
    thash = template_hash(pod_spec, spec.secret_digest)
    annotations = {SECRET_DIGEST_ANNOTATION: spec.secret_digest} if spec.secret_digest else {}
    if settings.prometheus_annotations:
        annotations.update(
            {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(settings.runtime_port),
                "prometheus.io/path": "/metrics",
            }
        )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": f"{name}-{thash}-",
            "namespace": model["metadata"]["namespace"],
            "labels": {
                **selector_labels(name),
                HASH_LABEL: thash,
                SPEC_LABEL: spec_hash(model),
                COMPONENT_LABEL: "inference",
                **ENGINE_TYPE_LABEL,
                **MANAGED_BY,
            },
            "ownerReferences": [owner_reference(model)],
            **({"annotations": annotations} if annotations else {}),
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
