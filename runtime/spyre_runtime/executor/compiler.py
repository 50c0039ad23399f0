"""How the decoder's step is compiled: the torch.compile backend, regional compilation of groups of decoder
blocks (inductor) with their parameter guards filtered and, once warm, one guard check a step instead of one a
group (GroupGraphs), inductor's settings while a graph is traced, and the dynamic token range of the mixed
step's one graph. Of this module only the compiled block groups run per step once warm (BlockCompiler._call);
the executor calls its step directly (model_executor.py)."""

from __future__ import annotations

import contextlib
import functools
import threading

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


# a graph input that differs between the groups of one step: the group's own blocks' tensors (parameters, KV
# cache layers) and the hidden states it is given; every other input is one of the step's, the same for all
PER_GROUP = ("L['members']", "L['kv_states']", "L['x']")


class _LastCall(threading.local):
    call: tuple | None = None  # the last graph of the block groups run: (GroupGraph, its inputs, its outputs)


_LAST = _LastCall()


class GroupGraph:
    """One compiled graph of the block groups (a dynamo cache entry) and, from dynamo's source names of its
    placeholders, which of its inputs are a group's own (PER_GROUP), as code that reads them off the group's
    call (`L`: members, kv_states, x). `direct`: every input has a source, so a call can do without dynamo."""

    def __init__(self, compiled, names: list[str | None]) -> None:
        self.compiled = compiled
        self.direct = all(names)
        self.own: list = []
        if not self.direct:  # an input without a source: dynamo serves every call, no names to read
            return
        try:
            self.own = [(i, compile(n, n, "eval")) for i, n in enumerate(names) if n.startswith(PER_GROUP)]
        except SyntaxError:  # a source name that is no Python expression: this graph stays with dynamo
            self.direct = False


class GroupGraphs:
    """The block groups' dynamo backend: `backend`'s graphs, each noting (in _LAST) that it ran, with which
    inputs and outputs, so that BlockCompiler can check and then skip dynamo for the step's later groups."""

    def __init__(self, backend) -> None:
        self.backend = torch._dynamo.lookup_backend(backend)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        compiled = self.backend(gm, example_inputs)
        names = []
        for node in gm.graph.find_nodes(op="placeholder"):
            source = getattr(node.meta.get("grapharg"), "source", None)
            names.append(getattr(source, "name", None))
        graph = GroupGraph(compiled, [n if isinstance(n, str) else None for n in names])

        def run(*args):
            out = compiled(*args)
            _LAST.call = (graph, args, out)
            return out

        return run


def _same(planned: list, given: tuple) -> bool:
    return len(planned) == len(given) and all(
        a is b or (not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b)
        for a, b in zip(planned, given, strict=True)
    )


class BlockCompiler:
    """Regional compilation (inductor): a group of `group` consecutive decoder blocks is compiled once, and
    every group of the stack runs that one graph (blocks differ only in their weights and KV cache tensors,
    which are graph inputs), while the thin rest of the forward (embedding, final norm, LM head, picking the
    last tokens) runs eagerly around it. Dynamo traces and inductor compiles `group` blocks instead of the
    whole stack per shape, so warm-up is several times shorter, cold (no cache) and warm (with the graph
    cache dynamo still traces on every start: tracing the whole model was most of a warm start). Each call
    of the graph through dynamo costs guard checks and wrappers (0.3-0.5 ms a call, run 59), so the stack
    runs in a few calls, not one per block: the first block of a group runs the group, the others pass their
    input through.

    Once warm (`serve_direct`), only a step's first group goes through dynamo and its guards; the later groups
    call the graph dynamo chose for the first with the first's inputs, their own blocks' tensors and hidden
    states put in (GroupGraph.own): every other input of a group is the step's, the same object for all
    groups. Warm-up checks that on every step it runs (each later group, through dynamo, must have run the
    first group's graph on exactly those inputs); a model whose groups differ (a block's constant attribute:
    graphs of their own) keeps dynamo for every group.

    `dynamic_tokens` (min, max): while set, the hidden states are marked dynamic in their token dimension
    (dim 1), for the mixed step's one graph of any chunk length (see `mark_dynamic_chunk`); `dynamic_batch`
    in their batch dimension (dim 0), for the decode buckets' one graph (see `mark_dynamic_decode`)."""

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
            backend=GroupGraphs(backend),
            dynamic=False,
            fullgraph=True,
            options={"guard_filter_fn": without_parameter_guards},
        )
        self.dynamic_tokens: tuple[int, int] | None = None
        self.dynamic_batch: tuple[int, int] | None = None
        self.direct = False  # serve_direct
        self.checked = 0  # later groups' calls checked (warm-up)
        self.uniform = True  # every one ran the first group's graph on the planned inputs
        self._step: tuple | None = None  # the step's first group: (GroupGraph, inputs)
        self._plans: dict = {}  # (GroupGraph, first block) -> (its parameters, code for its other own inputs)
        for first in range(0, len(blocks), self.group):
            members = blocks[first : first + self.group]
            members[0].forward = functools.partial(self._call, members, kv_layers, first)
            for block in members[1:]:
                block.forward = _pass_through

    def serve_direct(self) -> bool:
        """After warm-up: the later groups of a step skip dynamo if warm-up found them all the first's."""
        self.direct = self.uniform and self.checked > 0
        return self.direct

    def _call(self, members, kv_layers, first, x, *, past_key_value_state=None, use_cache=False, **kwargs):
        own = {"members": members, "kv_states": tuple(kv_layers[first : first + len(members)]), "x": x}
        if first and self.direct and self._step is not None:
            graph, step_args = self._step
            (x,) = graph.compiled(*self._inputs(graph, step_args, first, own))
            return (x, past_key_value_state) if use_cache else x
        for dim, span in ((1, self.dynamic_tokens), (0, self.dynamic_batch)):
            if span is not None:
                torch._dynamo.mark_dynamic(x, dim, min=span[0], max=span[1])
        _LAST.call = None
        x = self.compiled(members, x, own["kv_states"], use_cache=use_cache, **kwargs)
        self._note(first, own, x)
        return (x, past_key_value_state) if use_cache else x

    def _note(self, first, own: dict, result) -> None:
        """After a group ran through dynamo: the step's first group's graph and inputs, or (warm-up) whether
        this later group ran them as planned."""
        call, _LAST.call = _LAST.call, None
        ran = call is not None and call[0].direct and len(call[2]) == 1 and call[2][0] is result
        if first == 0:
            self._step = call[:2] if ran else None
        elif not self.direct:
            planned = ran and self._step is not None and call[0] is self._step[0]
            try:
                self.uniform &= planned and _same(self._inputs(*self._step, first, own), call[1])
            except Exception:  # an input the plan cannot read off the group: dynamo for every group
                self.uniform = False
            self.checked += 1
        if not ran:
            self.uniform = False

    def _inputs(self, graph: GroupGraph, step_args: tuple, first: int, own: dict) -> list:
        """Group `first`'s inputs to `graph`: the step's (its first group's), with the group's own."""
        plan = self._plans.get((graph, first))
        if plan is None:  # the parameters never change after load (as without_parameter_guards has it)
            params, codes = [], []
            for i, code in graph.own:
                value = eval(code, {"L": own})
                if isinstance(value, torch.nn.Parameter):
                    params.append((i, value))
                else:
                    codes.append((i, code))
            plan = self._plans[(graph, first)] = (params, codes)
        args = list(step_args)
        for i, value in plan[0]:
            args[i] = value
        scope = {"L": own}
        for i, code in plan[1]:
            args[i] = eval(code, scope)
        return args


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
    _cache_tag_pass. The graphs' Python wrappers check no sizes (`size_asserts`): dynamo's guards check the
    inputs of a step's first block group, warm-up the later groups' (BlockCompiler), and our ops check their
    own; the 84 checks a group graph made cost 0.35 ms a decode step (1-1.7 %, bench/README.md run 60)."""
    if backend != "inductor":
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    settings = {"size_asserts": False}
    if cache_tag:
        settings["post_grad_custom_post_pass"] = _cache_tag_pass(cache_tag)
    if freeze:
        settings |= {"freezing": True, "cpp.weight_prepack": not cache_enabled}
    return inductor_config.patch(settings)


def chunk_range(config: RuntimeConfig) -> tuple[int, int]:
    """The token counts of the mixed step's chunk region that its one dynamic graph serves."""
    return CHUNK_ALIGN + config.prefill_pieces, config.max_num_batched_tokens + config.prefill_pieces


def cache_tag(config: RuntimeConfig) -> str:
    """The dynamic chunk range and decode batch range, for inductor's cache key (see _cache_tag_pass)."""
    tags = []
    if config.dynamic_chunks:
        low, high = chunk_range(config)
        tags.append(f"spyre-serve-chunks:{low}-{high}+{max(config.batch_buckets)}")
    if config.dynamic_decode is not None:
        tags.append("spyre-serve-decode:{}-{}".format(*config.dynamic_decode))
    return ";".join(tags)


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


def mark_dynamic_decode(
    span: tuple[int, int], blocks: BlockCompiler, input_ids, position_ids, _mask, slot_mapping, *rest
) -> None:
    """A paged decode step's batch dimension is dynamic (config.dynamic_decode, with block groups): the one
    graph the first bucket of `span` compiles serves the others. A step of another size (a bucket of 1) or
    a static decode (no sequence lengths) compiles a graph of its own. Only the compiling call needs the
    marks."""
    block_table, _slab_start, seq_lens = rest
    if seq_lens is None or not span[0] <= input_ids.shape[0] <= span[1]:
        return
    for t in (input_ids, position_ids, slot_mapping, block_table, seq_lens):
        torch._dynamo.mark_dynamic(t, 0, min=span[0], max=span[1])
    blocks.dynamic_batch = span
