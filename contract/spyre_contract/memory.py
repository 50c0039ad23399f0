"""The memory plan: before anything compiles, what a configuration needs on each card (or on the host, for
CPU backends) and whether it fits. The runtime prints it at start-up and stops when it cannot fit; the
operator runs the same plan before creating pods when the SpyreModel gives the model's dimensions.

Estimates, per tensor-parallel rank, from config.json (HF names), the dtype and the shape or bucket menu:
weights (every linear layer, embeddings, lm_head unless tied; sharded by the tp size), the KV cache (the
static shapes' preallocated slabs, or the continuous-batching block pool) and the largest activation of any
one compiled shape (the MLP's intermediate, attention scores and logits of its widest step)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from spyre_contract.architectures import checkpoint_dtype
from spyre_contract.environment import PROMPT_LEN_MULTIPLE, ContractError, EnvironmentSettings, round_up

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
WARN_FRACTION = 0.9
# A Spyre card's memory (IBM Spyre: 128 GB of LPDDR5 per card); SENDNN_INFERENCE_CARD_MEMORY_GIB overrides it
DEFAULT_CARD_MEMORY_GIB = 128.0


@dataclass(frozen=True)
class ModelDims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False
    head_size: int = 0  # config.json's head_dim when it is not hidden / heads (Qwen3); 0: hidden / heads

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @classmethod
    def from_config(cls, config: Mapping) -> ModelDims:
        """HF config.json names (llama, granite, mistral, bert, roberta, ...); an image-text model's
        (llava_next) from its text_config (its vision tower is not counted: a few percent of the weights).
        Granite 4 (granitemoehybrid): its dense MLP is `shared_intermediate_size` wide. Qwen3: an explicit
        `head_dim`. FP8 checkpoints: the runtime dequantizes them at load, so their weights are resident in
        the serving dtype and are counted at its size, not at one byte per weight."""
        config = config.get("text_config") or config
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            intermediate = config.get("intermediate_size")
            if config.get("model_type") == "granitemoehybrid" and config.get("shared_intermediate_size"):
                intermediate = config["shared_intermediate_size"]
            return cls(
                hidden=hidden,
                layers=int(config["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                intermediate=int(intermediate or 4 * hidden),
                vocab=int(config["vocab_size"]),
                tied=bool(config.get("tie_word_embeddings", False)),
                head_size=int(config.get("head_dim") or 0),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ContractError(f"config.json lacks what the memory plan needs ({e})") from None

    def num_params(self) -> int:
        kv = self.kv_heads * self.head_dim
        attention = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * kv
        mlp = (
            3 * self.hidden * self.intermediate
        )  # gated MLP (llama family); plain MLPs have 2: an overestimate
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * (attention + mlp + 2 * self.hidden) + embeddings


@dataclass(frozen=True)
class MemoryPlan:
    weights: int  # bytes per rank
    kv_cache: int
    activations: int  # the largest single shape's
    largest_shape: str
    capacity: int  # bytes available per rank
    where: str  # "card" or "host"
    packed_weights: int = 0  # CPU decoders: the linear weights packed again for oneDNN's GEMM
    panel_weights: int = 0  # and once more, in panels, for the steps of a few live rows (the row linear)

    @property
    def total(self) -> int:
        return self.weights + self.packed_weights + self.panel_weights + self.kv_cache + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    @property
    def is_tight(self) -> bool:
        return self.total > WARN_FRACTION * self.capacity

    def table(self) -> str:
        rows = [
            ("weights (per rank)", self.weights),
            *([("weights packed for oneDNN (CPU)", self.packed_weights)] if self.packed_weights else []),
            *([("weights in panels for few rows (CPU)", self.panel_weights)] if self.panel_weights else []),
            ("KV cache", self.kv_cache),
            (f"largest activation ({self.largest_shape})", self.activations),
            ("total", self.total),
            (f"{self.where} memory", self.capacity),
        ]
        width = max(len(r[0]) for r in rows)
        lines = [f"{name:<{width}}  {value / GIB:9.2f} GiB" for name, value in rows]
        lines.append(f"{'use':<{width}}  {100 * self.total / max(1, self.capacity):8.1f} %")
        return "\n".join(lines)

    def refusal(self) -> str:
        """The one line that stops start-up: the largest consumer and what would fit instead."""
        parts = {
            "weights": self.weights + self.packed_weights + self.panel_weights,
            "KV cache": self.kv_cache,
            "activations": self.activations,
        }
        name, largest = max(parts.items(), key=lambda kv: kv[1])
        room = self.capacity - (self.total - largest)
        if name == "weights":
            hint = "more cards (a larger tensor-parallel size) or a smaller dtype"
            if self.panel_weights:
                hint += ", or SENDNN_INFERENCE_ROW_LINEAR=0 (no copy in panels)"
        elif name == "KV cache":
            hint = (
                f"a KV cache of at most {max(0, room) / GIB:.2f} GiB "
                "(fewer sequences, a shorter max model length, or a narrower --kv-cache-dtype on CPU)"
            )
        else:
            under = max(0, room) / GIB
            hint = f"shapes whose activations stay under {under:.2f} GiB (smaller batches or prompts)"
        return (
            f"the memory plan does not fit: {self.total / GIB:.2f} GiB needed per rank, "
            f"{self.capacity / GIB:.2f} GiB of {self.where} memory; the largest consumer is the {name} "
            f"({largest / GIB:.2f} GiB): use {hint}"
        )


# what a CPU backend's linear layers keep beside their weights (plan_memory's `routing`; the runtime's
# linear.weight_routing): "packed", a copy packed for oneDNN (float32; bfloat16 where the CPU has AVX-512 or
# AVX-NE-CONVERT) and, with the row linear, one in panels; "plain", the panels only (bfloat16 where oneDNN
# packs none: the op's entry is the plain weight); "none", neither (float16 keeps ATen's GEMM)
ROUTINGS = ("packed", "plain", "none")


def plan_memory(
    dims: ModelDims,
    settings: EnvironmentSettings,
    capacity: int,
    where: str,
    dtype_bytes: int = 4,
    state_bytes: int = 0,
    kv_dtype_bytes: int = 0,
    routing: str = "packed",
) -> MemoryPlan:
    """`state_bytes`: a hybrid model's per-sequence Mamba state, counted with the KV cache; `kv_dtype_bytes`:
    the KV cache's element size when it is not the model's (--kv-cache-dtype). `routing`, on a CPU backend:
    what the runtime's linear layers keep beside their weights (`ROUTINGS`); the runtime knows it from its
    CPU, the operator, planning for any node, counts "packed", the most."""
    if routing not in ROUTINGS:
        raise ValueError(f"plan_memory: routing {routing!r} is not one of {', '.join(ROUTINGS)}")
    tp = max(1, settings.tensor_parallel_size)
    weights = dims.num_params() * dtype_bytes // tp
    kv_per_token = 2 * dims.layers * dims.kv_heads * dims.head_dim * (kv_dtype_bytes or dtype_bytes) // tp
    if settings.use_cb:
        blocks = settings.num_kv_blocks or 1 + settings.max_num_seqs * (
            round_up(settings.max_model_len) // PROMPT_LEN_MULTIPLE
        )
        kv = blocks * PROMPT_LEN_MULTIPLE * kv_per_token
        steps = [(settings.max_num_seqs, 1, round_up(settings.max_model_len), "decode")]
        steps.append((1, settings.max_num_batched_tokens, round_up(settings.max_model_len), "prefill chunk"))
    else:
        kv = max(s.batch_size * (s.prompt_len + s.new_tokens) for s in settings.shapes) * kv_per_token
        steps = [(s.batch_size, s.prompt_len, s.prompt_len + s.new_tokens, str(s)) for s in settings.shapes]
    kv += state_bytes
    largest, label = 0, ""
    for batch, tokens, context, name in steps:
        rows = batch * tokens
        mlp = rows * 2 * dims.intermediate * dtype_bytes // tp
        scores = batch * (dims.heads // tp or 1) * tokens * context * dtype_bytes
        logits = batch * dims.vocab * 4  # the last position's logits, sampled in fp32
        act = rows * 4 * dims.hidden * dtype_bytes + mlp + scores + logits
        if act > largest:
            largest, label = act, name
    # CPU backends run fp32 and bf16 linear layers through the runtime's packed op (linear.py), on a second
    # copy of their weights packed for oneDNN where it packs the dtype; fp16 keeps ATen's GEMM
    layers = 0
    if settings.backend != "sendnn" and dtype_bytes in (2, 4) and routing != "none":
        # the linear layers and the LM head; not an untied input embedding, nor a tensor-parallel head
        embedding = dims.vocab * dims.hidden * dtype_bytes
        unpacked = (0 if dims.tied else embedding) + (embedding if tp > 1 else 0)
        layers = max(0, weights - unpacked // tp)
    packed = layers if routing == "packed" else 0
    # the C++ extension's row linear reads one more copy of the same layers, in its panels (linear.py
    # `_put_in_panels`), unless it or the extension is off; a failed build makes none: an overestimate
    panels = layers if settings.cpu_kernels and settings.row_linear else 0
    return MemoryPlan(weights, kv, largest, label, capacity, where, packed, panels)


def resolved_dtype(backend: str, dtype: str, model_config: Mapping | None) -> str | None:
    """`dtype` (--dtype, spec.dtype) as the runtime runs the model: auto is float16 on Spyre cards (sendnn),
    else the dtype config.json names, float32 when it names none or one the runtime does not run; None for
    auto on a CPU backend when the checkpoint's config is not known."""
    if dtype != "auto":
        return dtype
    if backend == "sendnn":
        return "float16"
    if model_config is None:
        return None
    named = checkpoint_dtype(model_config)
    return named if named in DTYPE_BYTES else "float32"


def kv_cache_dtype_for(backend: str, dtype: str, kv_cache_dtype: str) -> str:
    """The KV cache's dtype for a model run in `dtype` (resolved, not auto): `kv_cache_dtype`
    (--kv-cache-dtype, SENDNN_INFERENCE_KV_CACHE_DTYPE), auto being the model's. Spyre cards keep the
    model's; on CPU a float32 model may narrow it to bfloat16 or float16 (what the attention kernels read
    under a float32 query), nothing else differs from the model's."""
    kv = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    if kv == dtype:
        return kv
    setting = f"a {kv} KV cache (--kv-cache-dtype, SENDNN_INFERENCE_KV_CACHE_DTYPE, spec.kvCacheDtype)"
    if backend == "sendnn":
        raise ContractError(
            f"{setting}: Spyre cards (backend sendnn) keep the KV cache in the model's {dtype}; set auto"
        )
    if dtype != "float32" or kv not in ("bfloat16", "float16"):
        raise ContractError(
            f"{setting} under a {dtype} model: only a float32 model takes a narrower (bfloat16 or float16) "
            "cache; set auto"
        )
    return kv


def host_memory_bytes() -> int:
    """The cgroup's memory limit when there is one, else the machine's RAM."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path).read().strip()  # noqa: SIM115
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    try:
        for line in open("/proc/meminfo"):  # noqa: SIM115
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def kv_blocks_for(plan: MemoryPlan, utilization: float, bytes_per_block: int, minimum: int) -> int:
    """vLLM's gpu_memory_utilization idea: the KV blocks that fit in `utilization` of the memory once the
    weights and the largest activation are placed (never fewer than `minimum`, which holds one sequence)."""
    room = utilization * plan.capacity - plan.weights - plan.activations
    return max(minimum, int(room // max(1, bytes_per_block)))


def volumetric_line(settings: EnvironmentSettings) -> str:
    """What Spyre's volumetric limit (VLLM_DT_MAX_BATCH_TKV_LIMIT) leaves of the decode batch."""
    rows = settings.max_batch_tkv_limit // round_up(settings.max_model_len)
    rest = "paused" if settings.pausing_enabled else "wait to be admitted"
    return (
        f"volumetric limit {settings.max_batch_tkv_limit} (rows x context of a decode step): {rows} rows "
        f"at the full {settings.max_model_len}-token context, the others {rest}"
    )
