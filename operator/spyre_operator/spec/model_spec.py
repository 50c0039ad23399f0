"""ModelSpec: a SpyreModel spec once validated (`parse.parse_spec`), as the builders and the reconcile read
it: frozen values with the defaults the CRD states (no validation here; the model's source parsed into its
scheme's type), `quantity_bytes` for its sizes, and InvalidSpec, the error that names the field a spec breaks
a rule with."""

from __future__ import annotations

from dataclasses import dataclass, field

from spyre_operator.spec.model_source import ModelSource


class InvalidSpec(ValueError):
    reason = "InvalidSpec"  # the condition's reason

    def __init__(self, field_path: str, rule: str) -> None:
        where = field_path if field_path.startswith("metadata.") else f"spec.{field_path}".rstrip(".")
        super().__init__(f"{where}: {rule}")
        self.field_path = field_path
        self.rule = rule


@dataclass(frozen=True)
class StaticShape:
    prompt_length: int
    new_tokens: int
    batch_size: int


@dataclass(frozen=True)
class GraphCache:
    enabled: bool = True
    size: str = "10Gi"
    storage_class: str | None = None
    access_mode: str = "ReadWriteMany"
    existing_claim: str | None = None
    retention: str = "Retain"
    precompile: bool = False


@dataclass(frozen=True)
class Devices:
    """Cards by Dynamic Resource Allocation (spec.devices): `cards` devices of the DeviceClass, all sharing
    the value of `match_attribute` when there are several."""

    device_class: str = "spyre-pf"
    match_attribute: str = "spyre.ibm.com/numaInfo"


DEFAULT_PICKER_PORT = 9002  # the endpoint picker's port, as the Gateway API Inference Extension serves it


@dataclass(frozen=True)
class EndpointPicker:
    """spec.inferencePool.endpointPickerRef: what the gateway asks which pod serves a request (InferencePool
    v1's EndpointPickerRef). `name` None: the Service `<model>-epp`; `port` None only for other kinds."""

    name: str | None = None
    group: str = ""
    kind: str = "Service"
    port: int | None = DEFAULT_PICKER_PORT
    failure_mode: str = "FailClose"


@dataclass(frozen=True)
class InferencePoolSpec:
    """spec.inferencePool: an InferencePool (inference.networking.k8s.io/v1) of the model's serving pods.
    `enabled` None: the operator's setting decides; `target_port` None: the runtime's port."""

    enabled: bool | None = None
    target_port: int | str | None = None
    app_protocol: str = "http"
    picker: EndpointPicker = field(default_factory=EndpointPicker)


@dataclass(frozen=True)
class Rollout:
    """How many pods above `replicas` may exist during a rollout, and how many of `replicas` may be
    unavailable (only used when there are no cards for a surge). Integers or percentages of replicas."""

    max_surge: int | str = "100%"
    max_unavailable: int | str = 1

    def resolve(self, replicas: int) -> tuple[int, int]:
        """(surge, unavailable) as pod counts: surge rounds up, unavailable rounds down (Deployment's
        rule), and at least one of them is positive so a rollout can always move."""
        surge = _scaled(self.max_surge, replicas, up=True)
        unavailable = _scaled(self.max_unavailable, replicas, up=False)
        if surge == 0 and unavailable == 0:
            unavailable = 1
        return surge, unavailable


def _scaled(value: int | str, replicas: int, up: bool) -> int:
    if isinstance(value, int):
        return value
    percent = int(value.rstrip("%"))
    return -(-replicas * percent // 100) if up else replicas * percent // 100


@dataclass(frozen=True)
class ApiKey:
    """spec.auth.apiKey.secretRef: the Secret and the key in it holding the model's API key."""

    secret_name: str
    key: str


@dataclass(frozen=True)
class Auth:
    """spec.auth: who may call the model. `api_key`: callers present the Secret's key; `kubernetes`: callers
    present a Kubernetes token allowed to `get` the SpyreModel. Neither: anyone who reaches the Service."""

    api_key: ApiKey | None = None
    kubernetes: bool = False


@dataclass(frozen=True)
class Tls:
    """spec.tls: the runtime serves HTTPS with the key pair (tls.crt, tls.key) of this Secret."""

    secret_name: str


@dataclass(frozen=True)
class ModelSpec:
    source: ModelSource  # spec.model.source (with secretRef and endpoint when it is downloaded)
    served_model_name: str
    architecture: str | None = None  # config.json's architectures[0], for the registry
    model_config: dict | None = None  # config.json's dimensions, for the memory plan
    require_known_config: bool = False
    cards: int = 1
    replicas: int = 1
    backend: str = "sendnn"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # spec.kvCacheDtype: the KV cache's own dtype (auto: the model's)
    task: str = "generate"
    mode: str = "static"  # parse_spec: spec.batching.mode, else continuous for generate, static for pooling
    shapes: tuple[StaticShape, ...] = (StaticShape(64, 20, 1),)
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    buckets: tuple[tuple[str, tuple[int, int, int]], ...] = ()  # (env name, (min, step, max))
    cache: GraphCache = field(default_factory=GraphCache)
    image: str | None = None
    card_resource: str | None = None  # spec.cardResource: overrides the operator's card resource
    devices: Devices | None = None  # spec.devices: cards by DRA instead of an extended resource
    resources: dict = field(default_factory=dict)
    env: tuple = ()
    node_selector: dict = field(default_factory=dict)
    tolerations: tuple = ()
    affinity: dict | None = None
    scheduler_name: str | None = None
    priority_class_name: str | None = None
    suspend: bool = False
    rollout: Rollout = field(default_factory=Rollout)
    inference_pool: InferencePoolSpec = field(default_factory=InferencePoolSpec)
    tracing_endpoint: str | None = None  # spec.tracing.otlpEndpoint: OTLP/HTTP traces URL (path defaulted)
    network_peers: tuple = ()  # spec.networkPolicy.from: who else reaches the API (NetworkPolicyPeers)
    kv_events_port: int | None = None  # spec.kvEvents: the port KV events are published on; None: off
    auth: Auth = field(default_factory=Auth)
    tls: Tls | None = None
    # observed, not parsed: a digest of the data of the Secrets the pods read (the API key's, the key pair's),
    # set by the reconcile (kinds/access.py) so that new data rolls the pods
    secret_digest: str = ""


_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}


def quantity_bytes(text: str) -> float:
    """A storage quantity (10Gi, 500M, 1.5Ti) in bytes."""
    text = str(text).strip()
    for suffix in sorted({**_BINARY, **_DECIMAL}, key=len, reverse=True):
        if suffix and text.endswith(suffix):
            return float(text[: -len(suffix)]) * {**_BINARY, **_DECIMAL}[suffix]
    return float(text)
