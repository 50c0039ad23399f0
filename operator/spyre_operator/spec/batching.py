"""spec.batching, validated: continuous batching's limits and bucket ranges, or static warm-up shapes, and the
warm-up lists of spec.env, which must keep one entry per shape. The CRD states the same rules in CEL."""

from __future__ import annotations

from spyre_contract.tasks import POOLING_TASKS

from spyre_operator.spec.model_spec import InvalidSpec, StaticShape
from spyre_operator.spec.pod_fields import int_field, object_field

# continuous batching's bucket ranges (min, step, max; expanded as Gaudi's docs say) and their variables
BUCKET_FIELDS = {
    "decodeBatchBuckets": "SENDNN_INFERENCE_CB_DECODE_BATCH_BUCKETS",
    "kvBuckets": "SENDNN_INFERENCE_CB_KV_BUCKETS",
    "prefillBuckets": "SENDNN_INFERENCE_CB_PREFILL_BUCKETS",
}
# said when a generate model's batching has no mode and continuous batching's limits are missing
DEFAULT_MODE_HINT = (
    " (continuous is the default for generate models; batching.mode: static keeps sendnn-inference 1.x's "
    "warm-up shapes)"
)


def parse_batching(spec: dict, task: str) -> dict:
    """spec.batching: continuous batching's limits and bucket ranges, or static warm-up shapes. Without
    batching.mode, the task's mode: continuous for generate (sendnn-inference 2.x's only mode for decoders),
    static for the pooling tasks (their only mode); the CRD's rules resolve it the same way."""
    batching = object_field(spec, "batching")
    mode = batching.get("mode", "static" if task in POOLING_TASKS else "continuous")
    if mode not in ("static", "continuous"):
        raise InvalidSpec("batching.mode", f"must be static or continuous, got {mode!r}")
    if task in POOLING_TASKS and mode != "static":
        raise InvalidSpec("batching.mode", f"{task} models run on static warm-up shapes, got {mode!r}")
    if mode == "static":
        return {"mode": mode, "shapes": _static_shapes(batching.get("shapes"), task)}
    return {"mode": mode, "shapes": (), **_continuous_batching(batching, defaulted="mode" not in batching)}


def _static_shapes(raw_shapes, task: str) -> tuple[StaticShape, ...]:
    if not raw_shapes:
        raise InvalidSpec("batching.shapes", "static batching needs at least one shape")
    if not isinstance(raw_shapes, list):
        raise InvalidSpec("batching.shapes", f"must be a list of shapes, got {raw_shapes!r}")
    parsed = []
    for i, s in enumerate(raw_shapes):
        at = f"batching.shapes[{i}]"
        if not isinstance(s, dict):
            raise InvalidSpec(at, "must be an object with promptLength, newTokens, batchSize")
        p = int_field(f"{at}.promptLength", s.get("promptLength"), minimum=64)
        if p % 64:
            raise InvalidSpec(f"{at}.promptLength", f"must be a multiple of 64, got {p}")
        if task in POOLING_TASKS:  # encoders generate nothing: a shape is a prompt length and a batch size
            n = 0
            if s.get("newTokens") not in (None, 0):
                raise InvalidSpec(f"{at}.newTokens", f"does not apply to {task} models")
        else:
            n = int_field(f"{at}.newTokens", s.get("newTokens"), minimum=1)
        b = int_field(f"{at}.batchSize", s.get("batchSize"), minimum=1, maximum=256)
        parsed.append(StaticShape(p, n, b))
    return tuple(parsed)


def _continuous_batching(batching: dict, defaulted: bool) -> dict:
    if batching.get("maxNumSeqs") is None or batching.get("maxModelLen") is None:
        why = DEFAULT_MODE_HINT if defaulted else ""
        raise InvalidSpec("batching", f"continuous batching needs maxNumSeqs and maxModelLen{why}")
    max_num_seqs = int_field("batching.maxNumSeqs", batching["maxNumSeqs"], minimum=1, maximum=256)
    max_model_len = int_field("batching.maxModelLen", batching["maxModelLen"], minimum=64)
    buckets = []
    for field_name, var in BUCKET_FIELDS.items():
        r = batching.get(field_name)
        if r is None:
            continue
        at = f"batching.{field_name}"
        if not isinstance(r, dict) or set(r) - {"min", "step", "max"}:
            raise InvalidSpec(at, f"must be an object with min, step and max, got {r!r}")
        values = tuple(int_field(f"{at}.{k}", r.get(k), minimum=1) for k in ("min", "step", "max"))
        buckets.append((var, values))
    chunk = None
    if batching.get("maxNumBatchedTokens") is not None:
        chunk = int_field("batching.maxNumBatchedTokens", batching["maxNumBatchedTokens"], minimum=64)
        if chunk % 64:
            raise InvalidSpec("batching.maxNumBatchedTokens", f"must be a multiple of 64, got {chunk}")
    return {
        "max_num_seqs": max_num_seqs,
        "max_model_len": max_model_len,
        "max_num_batched_tokens": chunk,
        "buckets": tuple(buckets),
    }


def check_warmup_env(env: tuple, task: str, batching: dict) -> None:
    """The runtime zips its warm-up lists into shapes: a list the env overrides keeps one entry per shape
    (the operator writes the lists from spec.batching.shapes; an alias spelling never overrides them)."""
    if batching["mode"] != "static":
        return
    lists = (
        ("PROMPT_LENS", "BATCH_SIZES")
        if task in POOLING_TASKS
        else ("PROMPT_LENS", "NEW_TOKENS", "BATCH_SIZES")
    )
    names = {f"SENDNN_INFERENCE_WARMUP_{v}" for v in lists}
    for var in env:
        value = var.get("value")
        if var["name"] in names and value is not None and value.strip():
            num_entries = len(value.split(","))
            if num_entries != len(batching["shapes"]):
                raise InvalidSpec(
                    "env",
                    f"warmup lists differ in length: {var['name']} has {num_entries} entries, "
                    f"spec.batching.shapes has {len(batching['shapes'])} (one entry per shape)",
                )
