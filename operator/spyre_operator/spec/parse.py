"""The SpyreModel spec, validated by the operator itself: the 1.20 API server ignores the CRD's CEL rules,
and a spec written before a CRD upgrade may predate its schema. Every rule the CRD states is checked here,
one section of the spec at a time (model, engine, batching, graphCache, the pod's own fields, rollout;
batching in spec/batching.py, auth and tls in spec/security.py), in the order a reader meets them; the first
broken rule is the one reported."""

from __future__ import annotations

import re

from spyre_contract import BACKEND_ALIASES, BACKENDS, DTYPES, ContractError
from spyre_contract.memory import kv_cache_dtype_for, resolved_dtype
from spyre_contract.source_uri import DOWNLOADED, SourceError, parse_source_uri
from spyre_contract.tasks import NO_KV_CACHE, POOLING_TASKS, TASKS

from spyre_operator.spec.batching import check_warmup_env, parse_batching
from spyre_operator.spec.model_source import CABundle, model_source
from spyre_operator.spec.model_spec import (
    DEFAULT_PICKER_PORT,
    EndpointPicker,
    GraphCache,
    InferencePoolSpec,
    InvalidSpec,
    ModelSpec,
    Rollout,
)
from spyre_operator.spec.pod_fields import DNS_NAME, int_field, object_field, parse_pod_fields, string_field
from spyre_operator.spec.security import parse_security

VALID_CARDS = (1, 2, 4, 8)
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|K|M|G|T)?$")
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # a Service name (RFC 1035 label)
PERCENT = re.compile(r"^(100|[1-9]?[0-9])%$")
# The model's name becomes a Service name and a label value; pod names add "-<hash>-<random>".
MAX_NAME = 63
# InferencePool v1 (Gateway API Inference Extension): its protocols, failure modes and reference kinds
APP_PROTOCOLS = ("http", "kubernetes.io/h2c")
FAILURE_MODES = ("FailOpen", "FailClose")
KIND = re.compile(r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$")


class UnknownConfiguration(InvalidSpec):
    """Known configurations are required and this one is not in the registry."""

    reason = "UnknownConfiguration"


def check_name(name: str) -> None:
    """The model's name names its Service (an RFC 1035 label) and is a label value of its pods."""
    if len(name) > MAX_NAME:
        raise InvalidSpec(
            "metadata.name", f"{name!r} is {len(name)} characters; at most {MAX_NAME} fit a Service name"
        )
    if not DNS_LABEL.match(name):
        raise InvalidSpec(
            "metadata.name",
            f"{name!r} must be a DNS label (lower-case letters, digits and '-', starting with a letter): "
            "it becomes the model's Service name",
        )


def parse_spec(name: str, spec: dict) -> ModelSpec:
    """Validates a SpyreModel spec (as stored, defaults applied or not) into a ModelSpec."""
    check_name(name)
    if not isinstance(spec, dict):
        raise InvalidSpec("", "must be an object")
    model = _model_section(name, spec)
    engine = _engine_fields(spec)
    batching = parse_batching(spec, engine["task"])
    cache = _graph_cache_section(object_field(spec, "graphCache"))
    require_known_config = _bool(spec, "requireKnownConfiguration")
    pod_fields = parse_pod_fields(spec)
    check_warmup_env(pod_fields["env"], engine["task"], batching)
    return ModelSpec(
        **model,
        **engine,
        **batching,
        cache=cache,
        require_known_config=require_known_config,
        **pod_fields,
        suspend=_bool(spec, "suspend"),
        rollout=_rollout(object_field(spec, "rollout")),
        inference_pool=_inference_pool_section(spec),
        **parse_security(spec, pod_fields["env"]),
    )


def _model_section(name: str, spec: dict) -> dict:
    """spec.model: where the weights are, what config.json says, the name the model is served under."""
    model = spec.get("model")
    if not isinstance(model, dict) or not model.get("source"):
        raise InvalidSpec("model.source", "is required")
    try:
        parsed = parse_source_uri(model["source"])
    except SourceError as e:
        raise InvalidSpec("model.source", str(e)) from None
    source = model_source(parsed, **_source_access(model, parsed.scheme))
    if source.is_downloaded and not object_field(spec, "graphCache").get("enabled", True):
        raise InvalidSpec(
            "graphCache.enabled",
            f"{parsed.scheme}:// models are downloaded into the graph-cache claim (its models/ folder): "
            "the graph cache must be enabled",
        )
    architecture = string_field(model, "architecture")
    model_config = model.get("config")
    if model_config is not None and not isinstance(model_config, dict):
        raise InvalidSpec("model.config", f"must be an object of config.json fields, got {model_config!r}")
    served = model.get("servedModelName")
    if served is not None and (not isinstance(served, str) or not served.strip()):
        raise InvalidSpec("model.servedModelName", f"must be a non-empty string, got {served!r}")
    return {
        "source": source,
        "served_model_name": served or name,
        "architecture": architecture,
        "model_config": model_config,
    }


ENDPOINT = re.compile(r"^https?://[^\s/?#@]+(/[^\s]*)?$")


def _source_access(model: dict, scheme: str) -> dict:
    """spec.model.secretRef, spec.model.endpoint and spec.model.caBundle: the loader's credentials (a
    Secret's name), the hub's or object store's URL and the CA certificates it trusts (a ConfigMap's key);
    only the downloaded schemes (hf, s3) use them."""
    secret_ref, endpoint = model.get("secretRef"), model.get("endpoint")
    ca_bundle = model.get("caBundle")
    for key, value in (("secretRef", secret_ref), ("endpoint", endpoint), ("caBundle", ca_bundle)):
        if value is not None and scheme not in DOWNLOADED:
            raise InvalidSpec(f"model.{key}", f"applies to hf:// and s3:// sources only, not {scheme}://")
    if secret_ref is not None and (not isinstance(secret_ref, str) or not DNS_NAME.match(secret_ref)):
        raise InvalidSpec("model.secretRef", f"must be a Secret's name (a DNS name), got {secret_ref!r}")
    if endpoint is not None and (not isinstance(endpoint, str) or not ENDPOINT.match(endpoint)):
        raise InvalidSpec("model.endpoint", f"must be an http:// or https:// URL, got {endpoint!r}")
    return {"secret_ref": secret_ref, "endpoint": endpoint, "ca_bundle": _ca_bundle(ca_bundle)}


CONFIG_MAP_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")


def _ca_bundle(value) -> CABundle | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"configMapName", "key"}:
        raise InvalidSpec("model.caBundle", f"must be an object with configMapName and key, got {value!r}")
    name, key = value.get("configMapName"), value.get("key", "ca.crt")
    if not isinstance(name, str) or len(name) > 253 or not DNS_NAME.match(name):
        raise InvalidSpec(
            "model.caBundle.configMapName", f"must be a ConfigMap's name (a DNS name), got {name!r}"
        )
    if not isinstance(key, str) or len(key) > 253 or not CONFIG_MAP_KEY.match(key):
        raise InvalidSpec(
            "model.caBundle.key", f"must be a ConfigMap key (letters, digits, '-', '_', '.'), got {key!r}"
        )
    return CABundle(name, key)


def _engine_fields(spec: dict) -> dict:
    """cards, replicas, backend, task, dtype and kvCacheDtype."""
    cards = spec.get("cards", 1)
    if cards not in VALID_CARDS or isinstance(cards, bool):
        raise InvalidSpec("cards", f"must be one of 1, 2, 4, 8, got {cards!r}")
    replicas = int_field("replicas", spec.get("replicas", 1), minimum=0)
    backend = spec.get("backend", "sendnn")
    if backend not in BACKENDS and backend not in BACKEND_ALIASES:
        raise InvalidSpec("backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
    backend = BACKEND_ALIASES.get(backend, backend)
    task = spec.get("task", "generate")
    if task not in TASKS:
        raise InvalidSpec("task", f"must be one of {', '.join(TASKS)}, got {task!r}")
    dtypes = _dtypes(spec, backend, task)
    return {"cards": cards, "replicas": replicas, "backend": backend, "task": task, **dtypes}


def _dtypes(spec: dict, backend: str, task: str) -> dict:
    """dtype, and kvCacheDtype: the KV cache's own (auto: the model's). Spyre cards keep the KV cache in the
    model's dtype, float16 unless spec.dtype says otherwise (the runtime's rule, kv_cache_dtype_for); a
    pooling model keeps no KV cache, so only auto means anything there."""
    dtype, kv_cache_dtype = spec.get("dtype", "auto"), spec.get("kvCacheDtype", "auto")
    for key, value in (("dtype", dtype), ("kvCacheDtype", kv_cache_dtype)):
        if value not in DTYPES:
            raise InvalidSpec(key, f"must be one of {', '.join(DTYPES)}, got {value!r}")
    if task in POOLING_TASKS and kv_cache_dtype != "auto":
        raise InvalidSpec("kvCacheDtype", f"{kv_cache_dtype!r} {NO_KV_CACHE}")
    if backend == "sendnn":
        on_cards = resolved_dtype(backend, dtype, None)
        try:
            kv_cache_dtype_for(backend, on_cards, kv_cache_dtype)
        except ContractError:
            raise InvalidSpec(
                "kvCacheDtype",
                f"must be auto or {on_cards} with backend sendnn, got {kv_cache_dtype!r}: Spyre cards keep "
                f"the KV cache in the model's {on_cards}",
            ) from None
    return {"dtype": dtype, "kv_cache_dtype": kv_cache_dtype}


def _graph_cache_section(gc: dict) -> GraphCache:
    """spec.graphCache: the claim the compiled graphs live in, and whether a Job fills it first."""
    if gc.get("existingClaim") and gc.get("storageClassName"):
        raise InvalidSpec("graphCache", "existingClaim and storageClassName exclude each other")
    size = gc.get("size", "10Gi")
    if not isinstance(size, str) or not QUANTITY.match(size):
        raise InvalidSpec("graphCache.size", f"must be a quantity like 10Gi, got {size!r}")
    if not re.search(r"[1-9]", size.rstrip("KMGTi")):
        raise InvalidSpec("graphCache.size", f"must be larger than zero, got {size!r}")
    access = gc.get("accessMode", "ReadWriteMany")
    if access not in ("ReadWriteMany", "ReadWriteOnce"):
        raise InvalidSpec("graphCache.accessMode", f"must be ReadWriteMany or ReadWriteOnce, got {access!r}")
    retention = gc.get("retention", "Retain")
    if retention not in ("Retain", "Delete"):
        raise InvalidSpec("graphCache.retention", f"must be Retain or Delete, got {retention!r}")
    if gc.get("precompile") and not gc.get("enabled", True):
        raise InvalidSpec("graphCache.precompile", "needs the graph cache: graphCache.enabled is false")
    for key in ("existingClaim", "storageClassName"):
        value = gc.get(key)
        if value is not None and (not isinstance(value, str) or not DNS_NAME.match(value)):
            raise InvalidSpec(f"graphCache.{key}", f"must be a DNS name, got {value!r}")
    return GraphCache(
        precompile=bool(gc.get("precompile", False)),
        enabled=bool(gc.get("enabled", True)),
        size=size,
        storage_class=gc.get("storageClassName"),
        access_mode=access,
        existing_claim=gc.get("existingClaim"),
        retention=retention,
    )


def _inference_pool_section(spec: dict) -> InferencePoolSpec:
    """spec.inferencePool: the model's InferencePool as the Gateway API Inference Extension's v1 API takes it
    (the section present means enabled, unless it says otherwise). Whether the target port is the runtime's
    is the operator's to say (kinds.inference_pool.check_inference_pool)."""
    if spec.get("inferencePool") is None:
        return InferencePoolSpec()
    pool = object_field(spec, "inferencePool")
    enabled = pool.get("enabled", True)
    if not isinstance(enabled, bool):
        raise InvalidSpec("inferencePool.enabled", f"must be true or false, got {enabled!r}")
    port = pool.get("targetPort")
    is_number = isinstance(port, int) and not isinstance(port, bool) and 1 <= port <= 65535
    if port is not None and not is_number and port != "http":
        raise InvalidSpec(
            "inferencePool.targetPort",
            f"must be the runtime's port: its number (1-65535) or its name http, got {port!r}",
        )
    protocol = pool.get("appProtocol", "http")
    if protocol not in APP_PROTOCOLS:
        raise InvalidSpec("inferencePool.appProtocol", f"must be http or kubernetes.io/h2c, got {protocol!r}")
    return InferencePoolSpec(enabled, port, protocol, _endpoint_picker(pool.get("endpointPickerRef")))


def _endpoint_picker(ref) -> EndpointPicker:
    """spec.inferencePool.endpointPickerRef: a Service by default, whose name must then be a Service's."""
    at = "inferencePool.endpointPickerRef"
    if ref is None:
        return EndpointPicker()
    if not isinstance(ref, dict):
        raise InvalidSpec(at, f"must be an object with a name, got {ref!r}")
    name = ref.get("name")
    if not isinstance(name, str) or not name or len(name) > 253:
        raise InvalidSpec(f"{at}.name", f"is required: the endpoint picker's name, got {name!r}")
    group = ref.get("group", "")
    if not isinstance(group, str) or (group and (len(group) > 253 or not DNS_NAME.match(group))):
        raise InvalidSpec(f"{at}.group", f"must be an API group (a DNS name) or empty, got {group!r}")
    kind = ref.get("kind", "Service")
    if not isinstance(kind, str) or len(kind) > 63 or not KIND.match(kind):
        raise InvalidSpec(f"{at}.kind", f"must be a resource kind like Service, got {kind!r}")
    if group == "" and kind == "Service" and (len(name) > MAX_NAME or not DNS_LABEL.match(name)):
        raise InvalidSpec(
            f"{at}.name",
            f"{name!r} is not a Service name (a DNS label: lower-case letters, digits and '-', at most 63)",
        )
    port = ref.get("port")
    if port is None:
        number = DEFAULT_PICKER_PORT if (group, kind) == ("", "Service") else None
    elif not isinstance(port, dict):
        raise InvalidSpec(f"{at}.port", f"must be an object with a number, got {port!r}")
    else:
        number = int_field(f"{at}.port.number", port.get("number"), minimum=1, maximum=65535)
    failure_mode = ref.get("failureMode", "FailClose")
    if failure_mode not in FAILURE_MODES:
        raise InvalidSpec(f"{at}.failureMode", f"must be FailOpen or FailClose, got {failure_mode!r}")
    return EndpointPicker(name, group, kind, number, failure_mode)


# ---- fields --------------------------------------------------------------------------------------


def _bool(spec: dict, key: str) -> bool:
    value = spec.get(key, False)
    if not isinstance(value, bool):
        raise InvalidSpec(key, f"must be true or false, got {value!r}")
    return value


def _rollout(value: dict) -> Rollout:
    parsed = {}
    for key, attr in (("maxSurge", "max_surge"), ("maxUnavailable", "max_unavailable")):
        if key not in value or value[key] is None:
            continue
        v = value[key]
        if isinstance(v, bool) or not (
            (isinstance(v, int) and v >= 0) or (isinstance(v, str) and PERCENT.match(v))
        ):
            raise InvalidSpec(f"rollout.{key}", f"must be a count >= 0 or a percentage like 25%, got {v!r}")
        parsed[attr] = v
    return Rollout(**parsed)
