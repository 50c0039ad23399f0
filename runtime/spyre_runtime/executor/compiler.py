"""How the decoder's step is compiled: the torch.compile backend, regional compilation of groups of decoder
blocks (inductor) with their parameter guards filtered, inductor's settings while a graph is traced, and the
dynamic token range of the mixed step's one graph. Of this module only the compiled block groups run per
step once warm (BlockCompiler._call); the executor calls its step directly (model_executor.py)."""

from __future__ import annotations

import contextlib
import functools

import torch

from spyre_runtime.config import CHUNK_ALIGN, ConfigError, RuntimeConfig


def compiler_for(backend: str, compile_only: bool = False):
    """Returns the torch.compile backend, or None for eager. torch_sendnn is imported only for sendnn;
    `compile_only` (a precompile Job) uses its card-less `sendnn_compile_only` backend."""
    if backend == "eager":
        return None
    if backend == "sendnn":
        try:
            import torch_sendnn  # noqa: F401  (registers the "sendnn" dynamo backend)
        except ImportError:
            raise ConfigError(
                "SENDNN_INFERENCE_DYNAMO_BACKEND=sendnn needs the torch_sendnn package (IBM Spyre stack), "
                "which is not installed; on CPU use SENDNN_INFERENCE_DYNAMO_BACKEND=inductor or eager"
            ) from None
        if compile_only:
            return "sendnn_compile_only"
    return backend


def compile_step(fn, backend_name: str, compile_only: bool = False):
    """The compiled hot step (static shapes); eager returns `fn` itself. fullgraph: a graph break would
    split the forward and run Python between its pieces; it fails instead."""
    backend = compiler_for(backend_name, compile_only)
    if backend is None:
        return fn
    return torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's stack of decoder blocks: its longest ModuleList whose modules are all of one class."""
    best: list[torch.nn.Module] = []
    for module in model.modules():
        same_class = isinstance(module, torch.nn.ModuleList) and len({type(m) for m in module}) == 1
        if same_class and len(module) > len(best):
            best = list(module)
    return best


# SmolLM2 (30 blocks), a decode step at batch 8 / a 256-token mixed step / warm-up from the inductor cache:
# whole model in one graph 122 ms / 1064 ms / 38 s; 30 calls of 1 block 136 / 1089 / 7 s; 5 calls of 6
# blocks 127 / 1075 / 11 s (bench/README.md, run 11)
MAX_BLOCK_CALLS = 5


def block_group_size(num_blocks: int, max_calls: int | None = None) -> int:
    """Blocks per compiled call: the fewest (a divisor of `num_blocks`) that need at most `max_calls`."""
    calls = max_calls or MAX_BLOCK_CALLS
    return next(k for k in range(1, num_blocks + 1) if num_blocks % k == 0 and num_blocks // k <= calls)


def _pass_through(x, *, past_key_value_state=None, use_cache=False, **_):
    """A block whose group's first block already ran it (BlockCompiler)."""
    return (x, past_key_value_state) if use_cache else x


def without_parameter_guards(entries) -> list[bool]:
    """Which of dynamo's guards a block group's graph keeps: all but the tensor guards on the blocks'
    parameters. Every group passes its own parameters to the one graph the groups share, and they never
    change after load; they were most of the tensors checked per call (about 36 of 6 blocks), and a decode
    step makes 5 calls. Everything else stays: guards on the step's tensors and arguments (which
    tell the decode graph of each bucket and the mixed graph apart), the dynamic range, global state, and
    the blocks' constant attributes (blocks that differ in one still compile graphs of their own). Parameters
    of another shape cannot slip through: the compiled graph checks the size and stride of every input."""
    return [not (e.guard_type == "TENSOR_MATCH" and isinstance(e.value, torch.nn.Parameter)) for e in entries]


class BlockCompiler:
    """Regional compilation (inductor): a group of `group` consecutive decoder blocks is compiled once, and
    every group of the stack runs that one graph (blocks differ only in their weights and KV cache tensors,
    which are graph inputs), while the thin rest of the forward (embedding, final norm, LM head, picking the
    last tokens) runs eagerly around it. Dynamo traces and inductor compiles `group` blocks instead of the
    whole stack per shape, so warm-up is several times shorter, cold (no cache) and warm (with the graph
    cache dynamo still traces on every start: tracing the whole model was most of a warm start). Each call
    of the graph costs guard checks and wrappers (about 0.8 ms here), so the stack runs in a few calls, not
    one per block: the first block of a group runs the group, the others pass their input through.

    `dynamic_tokens` (min, max): while set, the hidden states are marked dynamic in their token dimension
    (dim 1), for the mixed step's one graph of any chunk length (see `mark_dynamic_chunk`)."""

    def __init__(self, model: torch.nn.Module, backend, kv_layers: list) -> None:
        blocks = repeated_blocks(model)
        if len(blocks) < 2 or len(blocks) != len(kv_layers):
            raise ConfigError(f"{type(model).__name__}: no stack of decoder blocks to compile")
        self.group = block_group_size(len(blocks))
        forward = type(blocks[0]).forward

        def group_step(members, x, kv_states, **kwargs):
            for block, kv in zip(members, kv_states, strict=True):
                out = forward(block, x, past_key_value_state=kv, **kwargs)
                x = out[0] if isinstance(out, tuple) else out
            return x

        self.compiled = torch.compile(
            group_step,
            backend=backend,
            dynamic=False,
            fullgraph=True,
            options={"guard_filter_fn": without_parameter_guards},
        )
        self.dynamic_tokens: tuple[int, int] | None = None
        for first in range(0, len(blocks), self.group):
            members = blocks[first : first + self.group]
            members[0].forward = functools.partial(self._call, members, kv_layers, first)
            for block in members[1:]:
                block.forward = _pass_through

    def _call(self, members, kv_layers, first, x, *, past_key_value_state=None, use_cache=False, **kwargs):
        if self.dynamic_tokens is not None:
            low, high = self.dynamic_tokens
            torch._dynamo.mark_dynamic(x, 1, min=low, max=high)
        kvs = tuple(kv_layers[first : first + len(members)])
        x = self.compiled(members, x, kvs, use_cache=use_cache, **kwargs)
        return (x, past_key_value_state) if use_cache else x


def _cache_tag_pass(tag: str):
    """A post-grad pass that changes nothing and puts `tag` in inductor's FX-graph cache key (inductor
    hashes a custom pass by its uuid()). A graph with a dynamic dimension is cached with the range it was
    compiled for; without the tag, a later compile of the same graph for a wider range (another token
    budget) hits that entry, inherits its narrower bound and fails at warm-up (ConstraintViolationError)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class CacheTag(CustomGraphPass):  # inductor bypasses its cache for a pass of any other class
        def __call__(self, graph) -> None:
            return None

        def uuid(self) -> str:
            return tag

    return CacheTag()


def compile_settings(backend: str, cache_enabled: bool = False, freeze: bool = True, cache_tag: str = ""):
    """Inductor settings while a graph is traced and compiled (warmup). With `freeze` off (the decoder's
    linear layers already run on weights prepacked at run time, linear.py) nothing is changed: the weights
    stay graph inputs, so compiling is shorter and a cached graph holds no copy of them (measured on SmolLM2,
    two graphs: cold 64 s instead of 72, warm from the inductor cache 13 s instead of 24, same decode step).
    Otherwise `freezing` turns the weights into
    constants, folded and prepacked for oneDNN (2-3x faster small-batch GEMMs on CPU). It must be on while
    dynamo traces, not only while inductor compiles: dynamo installs the parameters as graph attributes
    (constants) only then; otherwise they are graph inputs and nothing is frozen. The KV cache tensors are
    never parameters: they stay graph inputs, mutated in place. With the graph cache on, the weights are not
    prepacked as mkldnn tensors: those cannot be pickled, so the compiled graph would bypass the cache and
    every start would compile again (frozen, unpacked weights cache fine). `cache_tag`: see
    _cache_tag_pass."""
    if backend != "inductor":
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    settings = {"post_grad_custom_post_pass": _cache_tag_pass(cache_tag)} if cache_tag else {}
    if freeze:
        settings |= {"freezing": True, "cpp.weight_prepack": not cache_enabled}
    return inductor_config.patch(settings)


def chunk_range(config: RuntimeConfig) -> tuple[int, int]:
    """The token counts of the mixed step's chunk region that its one dynamic graph serves."""
    return CHUNK_ALIGN + config.prefill_pieces, config.max_num_batched_tokens + config.prefill_pieces


def cache_tag(config: RuntimeConfig) -> str:
    """The dynamic chunk range, for inductor's cache key (see _cache_tag_pass)."""
    if not config.dynamic_chunks:
        return ""
    low, high = chunk_range(config)
    return f"spyre-serve-chunks:{low}-{high}+{max(config.batch_buckets)}"


def mark_dynamic_chunk(
    config: RuntimeConfig, blocks: BlockCompiler | None, input_ids, position_ids, _mask, slot_mapping, *rest
) -> None:
    """A mixed step's token dimension is dynamic (config.dynamic_chunks): the one graph compiled for it
    serves every chunk length from CHUNK_ALIGN to max_num_batched_tokens (a length outside that range
    would compile again, which serving refuses). Only the compiling call needs the marks."""
    *_, token_piece, token_pos = rest
    rows = max(config.batch_buckets)  # the decode tokens after the chunk region
    low, high = chunk_range(config)
    for t in (input_ids, position_ids, slot_mapping):
        torch._dynamo.mark_dynamic(t, 1, min=low + rows, max=high + rows)
    for t in (token_piece, token_pos):
        torch._dynamo.mark_dynamic(t, 0, min=low, max=high)
    if blocks is not None:  # the hidden states the blocks get: [1, chunk + rows, D]
        blocks.dynamic_tokens = (low + rows, high + rows)
