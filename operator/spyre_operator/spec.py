"""The SpyreModel spec, validated by the operator itself: the 1.20 API server ignores the CRD's CEL rules,
and a spec written before a CRD upgrade may predate its schema. Every rule the CRD states is checked here."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

VALID_CARDS = (1, 2, 4, 8)
BACKENDS = ("sendnn", "inductor", "eager")
SOURCE = re.compile(r"^(pvc://(?P<claim>[a-z0-9]([-a-z0-9.]*[a-z0-9])?)/(?P<path>.*)|file://(?P<file>/.+))$")
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|K|M|G|T)?$")


class InvalidSpec(ValueError):
    def __init__(self, field_path: str, rule: str) -> None:
        super().__init__(f"spec.{field_path}: {rule}")
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
class ModelSpec:
    source: str
    served_model_name: str
    cards: int = 1
    replicas: int = 1
    backend: str = "sendnn"
    mode: str = "static"
    shapes: tuple[StaticShape, ...] = (StaticShape(64, 20, 1),)
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    cache: GraphCache = field(default_factory=GraphCache)
    image: str | None = None
    resources: dict = field(default_factory=dict)
    env: tuple = ()
    node_selector: dict = field(default_factory=dict)
    tolerations: tuple = ()
    affinity: dict | None = None
    scheduler_name: str | None = None
    priority_class_name: str | None = None
    suspend: bool = False

    @property
    def pvc_claim(self) -> str | None:
        m = SOURCE.match(self.source)
        return m.group("claim") if m else None

    @property
    def model_path_in_pod(self) -> str:
        m = SOURCE.match(self.source)
        if m.group("claim"):
            return "/models/" + m.group("path").strip("/")
        return m.group("file")


def _int(spec: dict, path: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSpec(path, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise InvalidSpec(path, f"must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidSpec(path, f"must be at most {maximum}, got {value}")
    return value


def parse_spec(name: str, spec: dict) -> ModelSpec:
    """Validates a SpyreModel spec (as stored, defaults applied or not) into a ModelSpec."""
    model = spec.get("model")
    if not isinstance(model, dict) or not model.get("source"):
        raise InvalidSpec("model.source", "is required")
    source = model["source"]
    if not isinstance(source, str) or not SOURCE.match(source):
        raise InvalidSpec("model.source", f"must be pvc://CLAIM/PATH or file:///PATH, got {source!r}")
    cards = spec.get("cards", 1)
    if cards not in VALID_CARDS or isinstance(cards, bool):
        raise InvalidSpec("cards", f"must be one of 1, 2, 4, 8, got {cards!r}")
    replicas = _int(spec, "replicas", spec.get("replicas", 1), minimum=0)
    backend = spec.get("backend", "sendnn")
    if backend not in BACKENDS:
        raise InvalidSpec("backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")

    batching = spec.get("batching") or {}
    mode = batching.get("mode", "static")
    if mode not in ("static", "continuous"):
        raise InvalidSpec("batching.mode", f"must be static or continuous, got {mode!r}")
    shapes: tuple[StaticShape, ...] = ()
    max_num_seqs = max_model_len = chunk = None
    if mode == "static":
        raw_shapes = batching.get("shapes")
        if not raw_shapes:
            raise InvalidSpec("batching.shapes", "static batching needs at least one shape")
        parsed = []
        for i, s in enumerate(raw_shapes):
            at = f"batching.shapes[{i}]"
            if not isinstance(s, dict):
                raise InvalidSpec(at, "must be an object with promptLength, newTokens, batchSize")
            p = _int(spec, f"{at}.promptLength", s.get("promptLength"), minimum=64)
            if p % 64:
                raise InvalidSpec(f"{at}.promptLength", f"must be a multiple of 64, got {p}")
            n = _int(spec, f"{at}.newTokens", s.get("newTokens"), minimum=1)
            b = _int(spec, f"{at}.batchSize", s.get("batchSize"), minimum=1, maximum=256)
            parsed.append(StaticShape(p, n, b))
        shapes = tuple(parsed)
    else:
        if batching.get("maxNumSeqs") is None or batching.get("maxModelLen") is None:
            raise InvalidSpec("batching", "continuous batching needs maxNumSeqs and maxModelLen")
        max_num_seqs = _int(spec, "batching.maxNumSeqs", batching["maxNumSeqs"], minimum=1, maximum=256)
        max_model_len = _int(spec, "batching.maxModelLen", batching["maxModelLen"], minimum=64)
        if batching.get("maxNumBatchedTokens") is not None:
            chunk = _int(spec, "batching.maxNumBatchedTokens", batching["maxNumBatchedTokens"], minimum=64)
            if chunk % 64:
                raise InvalidSpec("batching.maxNumBatchedTokens", f"must be a multiple of 64, got {chunk}")

    gc = spec.get("graphCache") or {}
    if gc.get("existingClaim") and gc.get("storageClassName"):
        raise InvalidSpec("graphCache", "existingClaim and storageClassName exclude each other")
    size = gc.get("size", "10Gi")
    if not isinstance(size, str) or not QUANTITY.match(size):
        raise InvalidSpec("graphCache.size", f"must be a quantity like 10Gi, got {size!r}")
    access = gc.get("accessMode", "ReadWriteMany")
    if access not in ("ReadWriteMany", "ReadWriteOnce"):
        raise InvalidSpec("graphCache.accessMode", f"must be ReadWriteMany or ReadWriteOnce, got {access!r}")
    retention = gc.get("retention", "Retain")
    if retention not in ("Retain", "Delete"):
        raise InvalidSpec("graphCache.retention", f"must be Retain or Delete, got {retention!r}")
    if gc.get("precompile") and not gc.get("enabled", True):
        raise InvalidSpec("graphCache.precompile", "needs the graph cache: graphCache.enabled is false")
    cache = GraphCache(
        precompile=bool(gc.get("precompile", False)),
        enabled=bool(gc.get("enabled", True)),
        size=size,
        storage_class=gc.get("storageClassName"),
        access_mode=access,
        existing_claim=gc.get("existingClaim"),
        retention=retention,
    )
    env = spec.get("env") or []
    for i, var in enumerate(env):
        if not isinstance(var, dict) or not var.get("name"):
            raise InvalidSpec(f"env[{i}]", "must be an object with a name")
    return ModelSpec(
        source=source,
        served_model_name=model.get("servedModelName") or name,
        cards=cards,
        replicas=replicas,
        backend=backend,
        mode=mode,
        shapes=shapes,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=chunk,
        cache=cache,
        image=spec.get("image"),
        resources=spec.get("resources") or {},
        env=tuple(env),
        node_selector=spec.get("nodeSelector") or {},
        tolerations=tuple(spec.get("tolerations") or ()),
        affinity=spec.get("affinity"),
        scheduler_name=spec.get("schedulerName"),
        priority_class_name=spec.get("priorityClassName"),
        suspend=bool(spec.get("suspend", False)),
    )
