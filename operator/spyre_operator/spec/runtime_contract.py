"""What a runtime pod is told, and whether the runtime would accept it: its environment (the contract of
shared/DESIGN.md section 2) and flags, derived from the spec, and the runtime's own rules (the shared
contract: environment, memory plan, known configurations) run on them before any pod exists."""

from __future__ import annotations

import json

from spyre_contract import ContractError, EngineFlags, read_environment
from spyre_contract.memory import DTYPE_BYTES, GIB, ModelDims, kv_cache_dtype_for, plan_memory, resolved_dtype
from spyre_contract.registry import check_known_config
from spyre_contract.tasks import POOLING_TASKS, read_pooling_environment

from spyre_operator.settings import OperatorSettings
from spyre_operator.spec.model_spec import InvalidSpec, ModelSpec, quantity_bytes
from spyre_operator.spec.parse import UnknownConfiguration

CACHE_MOUNT = "/cache"


def runtime_env(spec: ModelSpec, serving: bool = True) -> list[dict]:
    """The environment contract of shared/DESIGN.md section 2, derived from the spec. Serving pods of a
    precompiled model must find their graphs in the cache (the compile Job, `serving=False`, fills it)."""
    env = [
        {"name": "SENDNN_INFERENCE_DYNAMO_BACKEND", "value": spec.backend},
        {"name": "SENDNN_INFERENCE_USE_CB", "value": "1" if spec.mode == "continuous" else "0"},
    ]
    env += [{"name": var, "value": ",".join(map(str, r))} for var, r in spec.buckets]
    if spec.dtype != "auto":
        env.append({"name": "SENDNN_INFERENCE_DTYPE", "value": spec.dtype})
    if spec.kv_cache_dtype != "auto":
        env.append({"name": "SENDNN_INFERENCE_KV_CACHE_DTYPE", "value": spec.kv_cache_dtype})
    if spec.mode == "static":
        lists = [
            ("PROMPT_LENS", "prompt_length"),
            ("NEW_TOKENS", "new_tokens"),
            ("BATCH_SIZES", "batch_size"),
        ]
        if spec.task in POOLING_TASKS:  # encoders: prompt lengths and batch sizes only
            lists = [lists[0], lists[2]]
        env += [
            {
                "name": f"SENDNN_INFERENCE_WARMUP_{var}",
                "value": ",".join(str(getattr(s, attr)) for s in spec.shapes),
            }
            for var, attr in lists
        ]
    if spec.cache.enabled:
        env += [
            {"name": "TORCH_SENDNN_CACHE_ENABLE", "value": "1"},
            {"name": "TORCH_SENDNN_CACHE_DIR", "value": f"{CACHE_MOUNT}/graphs"},
        ]
        if spec.cache.precompile and serving:
            env.append({"name": "SENDNN_INFERENCE_REQUIRE_PRECOMPILED_DECODERS", "value": "1"})
    env += [
        {"name": "HOME", "value": "/tmp"},  # the root filesystem is read-only; caches go to /tmp
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    user = {v["name"] for v in spec.env}
    return [v for v in env if v["name"] not in user] + [dict(v) for v in spec.env]


def runtime_args(spec: ModelSpec, settings: OperatorSettings) -> list[str]:
    serving = ["--served-model-name", spec.served_model_name, "--host", "$(POD_IP)", "--port"]
    task = ["--task", spec.task] if spec.task != "generate" else []
    return [
        "serve",
        spec.source.path_in_pod,
        *serving,
        str(settings.runtime_port),
        *task,
        *engine_args(spec),
        *kv_events_args(spec),
    ]


def kv_events_args(spec: ModelSpec) -> list[str]:
    """spec.kvEvents: vLLM's flag, the runtime binding its publisher on every address of the pod."""
    if spec.kv_events_port is None:
        return []
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{spec.kv_events_port}"}
    return ["--kv-events-config", json.dumps(config)]


def engine_args(spec: ModelSpec) -> list[str]:
    """The flags that shape the compiled graphs (serving pods and the compile Job share them)."""
    args = ["--tensor-parallel-size", str(spec.cards)]
    if spec.mode == "continuous":
        args += ["--max-num-seqs", str(spec.max_num_seqs), "--max-model-len", str(spec.max_model_len)]
        if spec.max_num_batched_tokens:
            args += ["--max-num-batched-tokens", str(spec.max_num_batched_tokens)]
    return args


# the runtime's flags, as the SpyreModel spells them
SPEC_FIELD_OF_FLAG = {
    "--max-num-batched-tokens": "batching.maxNumBatchedTokens",
    "--max-model-len": "batching.maxModelLen",
    "--max-num-seqs": "batching.maxNumSeqs",
    "--tensor-parallel-size": "cards",
}


def check_runtime_contract(spec: ModelSpec) -> None:
    """Runs the runtime's own rules (the shared contract) on the environment and flags a serving pod
    would get, user `env` included; raises InvalidSpec with the runtime's one-line reason."""
    environ = {v["name"]: v["value"] for v in runtime_env(spec) if "value" in v}
    args = engine_args(spec)
    flag_values = {args[i]: int(args[i + 1]) for i in range(0, len(args), 2)}
    flags = EngineFlags(
        max_model_len=flag_values.get("--max-model-len"),
        max_num_seqs=flag_values.get("--max-num-seqs"),
        tensor_parallel_size=flag_values.get("--tensor-parallel-size"),
        max_num_batched_tokens=flag_values.get("--max-num-batched-tokens"),
    )
    try:
        if spec.task in POOLING_TASKS:
            return read_pooling_environment(environ, flags)
        return read_environment(environ, flags)
    except ContractError as e:
        message = str(e)
        for flag, path in SPEC_FIELD_OF_FLAG.items():
            message = message.replace(flag, f"spec.{path}")
        user = {v["name"] for v in spec.env}
        named = next((n for n in user if n in message), None)
        raise InvalidSpec("env" if named else "batching", f"the runtime would refuse it: {message}") from None


def _kv_cache_dtype(spec: ModelSpec, dtype: str, kv_cache_dtype: str) -> str:
    """The runtime's rule on the KV cache's dtype (kv_cache_dtype_for) on what the pod would get, user env
    included: an env override the spec's fields do not show is refused here, not by a crash-looping pod."""
    try:
        return kv_cache_dtype_for(spec.backend, dtype, kv_cache_dtype)
    except ContractError as e:
        user = {v["name"] for v in spec.env}
        overridden = bool(user & {"SENDNN_INFERENCE_KV_CACHE_DTYPE", "SENDNN_INFERENCE_DTYPE"})
        raise InvalidSpec(
            "env" if overridden else "kvCacheDtype", f"the runtime would refuse it: {e}"
        ) from None


def check_fit(spec: ModelSpec, settings: OperatorSettings) -> None:
    """The runtime's memory plan and the known-configurations registry, run before any pod exists, as far
    as the spec tells the model (`model.config`, `model.architecture`): InvalidSpec when the plan cannot fit
    the cards requested (or the container's memory limit on CPU backends), UnknownConfiguration when known
    configurations are required (spec or settings) and this one is not."""
    if spec.kv_events_port is not None and spec.mode != "continuous":
        raise InvalidSpec("kvEvents", "needs continuous batching: KV events come from its prefix cache")
    if spec.kv_events_port == settings.runtime_port:
        raise InvalidSpec("kvEvents.port", f"{spec.kv_events_port} is the runtime's API port")
    contract = check_runtime_contract(spec)
    dtype = resolved_dtype(spec.backend, contract.dtype, spec.model_config or None)  # user env included
    kv_dtype = _kv_cache_dtype(spec, dtype, contract.kv_cache_dtype) if dtype else None
    if spec.model_config:
        try:
            dims = ModelDims.from_config(spec.model_config)
        except ContractError as e:
            raise InvalidSpec("model.config", str(e)) from None
        limit = ((spec.resources.get("limits") or {}).get("memory")) if spec.backend != "sendnn" else None
        if spec.backend == "sendnn":
            capacity, where = int(settings.card_memory_gib * GIB), "card"
        elif limit is not None:
            capacity, where = int(quantity_bytes(limit) / spec.cards), "container"
        else:
            capacity, where = 0, ""
        if capacity:
            dtype_bytes, kv_bytes = DTYPE_BYTES.get(dtype, 4), DTYPE_BYTES.get(kv_dtype, 4)
            plan = plan_memory(dims, contract, capacity, where, dtype_bytes, kv_dtype_bytes=kv_bytes)
            if not plan.fits:
                raise InvalidSpec("cards", plan.refusal())
    if spec.require_known_config or settings.require_known_config:
        if not spec.architecture:
            raise InvalidSpec(
                "model.architecture",
                "is required when known configurations are required (config.json's architectures)",
            )
        verdict = check_known_config(
            spec.architecture,
            task=spec.task,
            tensor_parallel_size=spec.cards,
            max_model_len=contract.max_model_len,
            max_num_seqs=contract.max_num_seqs,
            shapes=contract.shapes if spec.task in POOLING_TASKS else (),
            model_config=spec.model_config,
        )
        if not verdict.is_known:
            raise UnknownConfiguration("", verdict.message)
