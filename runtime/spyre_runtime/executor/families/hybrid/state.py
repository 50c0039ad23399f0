"""A hybrid model's per-sequence Mamba state: one slot per sequence, beside the paged KV cache.

Every Mamba layer owns two fixed tensors, written in place by `mamba_mix` (mixer.py):

    conv [num_slots, conv_dim, conv_kernel]          ssm [num_slots, heads, head_dim, state_size]

Slot 0 is scratch. Continuous batching: the scheduler gives each admitted request a slot
(engine/state_slots.py, `Request.state_slot`) and frees it when the request finishes, is aborted or
preempted (a preempted request prefills again from its first token, so its state is recomputed). Static
batching: row r of the running batch is slot r + 1. The model is built of FMS's `bamba` blocks (Mamba-2
layers beside attention layers; loader.py); its Mamba blocks run `mamba_block_forward`, which reads
the slot tensors handed to the model as those layers' `past_key_value_states` (the attention layers get
their paged KV cache tensors). The
layout of a step's tokens over sequences and slots (`static_layout`, `continuous_layout`) is Python beside
the compiled graph, not an input of it: one graph per shape, as for a dense model.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
from spyre_contract.hybrid import HybridModelError, HybridSpec

from spyre_runtime.config import ConfigError, RuntimeConfig, Shape
from spyre_runtime.executor.families.hybrid.loader import load_hybrid_model
from spyre_runtime.executor.families.hybrid.mixer import (
    MambaLayout,
    mamba_mix,
    mamba_mix_stateless,
    mixer_weights,
    step_layout,
)
from spyre_runtime.executor.loader import resolve_dtype
from spyre_runtime.steps import ContinuousStep, StaticStep

log = logging.getLogger(__name__)


def check_supported(config: RuntimeConfig) -> None:
    """What hybrid models are not served with, as one line at start-up."""
    if config.backend == "sendnn":
        raise ConfigError("hybrid (Mamba) models run on the eager and inductor backends only, not sendnn")
    if config.tensor_parallel_size > 1:
        raise ConfigError("hybrid (Mamba) models run with --tensor-parallel-size 1 only")
    if config.use_cb and config.enable_prefix_caching:  # load_config turns it off (config.hybrid_settings)
        raise ConfigError("hybrid (Mamba) models run with prefix caching off (--no-enable-prefix-caching)")


def mamba_block_forward(
    block, x, *, position_ids=None, past_key_value_state=None, use_cache=False, cache_position=None, **kwargs
):
    """FMS BambaBlock's forward for a Mamba block, with the sequence part in `mamba_mix`.
    x: [B, L, D] -> [B, L, D]; past_key_value_state: (conv, ssm) slot tensors, or None (no cache)."""
    residual = x
    ssm = block.ssm
    rows, tokens, _ = x.shape
    gate, xbc, dt = ssm.in_proj(block.ln(x)).split([ssm.intermediate_size, ssm.conv_dim, ssm.nheads], dim=-1)
    xbc, dt = xbc.reshape(rows * tokens, -1), dt.reshape(rows * tokens, -1)
    if past_key_value_state is None:
        y = mamba_mix_stateless(xbc, dt, ssm, rows, tokens)
    else:
        y = mamba_mix(xbc, dt, *past_key_value_state, *mixer_weights(ssm))
    x = ssm.out_proj(ssm.norm(y.view(rows, tokens, -1), gate).to(x.dtype)) + residual
    x = block.ff_sub_layer(block.ff_ln(x)) + x
    return (x, past_key_value_state) if use_cache else x


class MambaStates:
    """The slot tensors of every Mamba layer of `model` (FMS bamba), and its Mamba blocks switched to
    `mamba_block_forward`."""

    def __init__(self, model: torch.nn.Module, spec: HybridSpec, num_slots: int, dtype: torch.dtype) -> None:
        blocks = list(model.base_model.layers)
        mamba = [i for i, b in enumerate(blocks) if getattr(b, "is_mamba_layer", False)]
        if tuple(mamba) != spec.mamba_layers:
            raise HybridModelError(
                f"the model's Mamba layers {mamba} are not config.json's {spec.mamba_layers}"
            )
        self.spec = spec
        self.num_slots = num_slots
        self.layers = {
            i: (
                torch.zeros(num_slots, spec.conv_dim, spec.conv_kernel, dtype=dtype),
                torch.zeros(num_slots, spec.heads, spec.head_dim, spec.state_size, dtype=dtype),
            )
            for i in mamba
        }
        for i in mamba:
            blocks[i].forward = functools.partial(mamba_block_forward, blocks[i])

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes + s.nbytes for c, s in self.layers.values())

    def step_context(self, step, prefill_pieces: int):
        """Within: `step`'s layout for the Mamba layers."""
        return step_context(self, step, prefill_pieces)

    def cache_states(self, kv_layers: list) -> list:
        """One entry per block: a Mamba block's slot tensors, an attention block's KV cache tensors."""
        kv = iter(kv_layers)
        return [self.layers[i] if i in self.layers else next(kv) for i in range(self.spec.num_layers)]


def num_slots_for(config: RuntimeConfig) -> int:
    """Scratch + one per sequence: max_num_seqs (continuous), the widest shape's rows (static)."""
    return 1 + (config.max_num_seqs if config.use_cb else max(s.batch_size for s in config.shapes))


def attach(model: torch.nn.Module, config: RuntimeConfig, dtype: torch.dtype) -> MambaStates | None:
    """The model's Mamba states (None for a model without Mamba layers)."""
    spec = HybridSpec.from_model_dir(config.model_dir)
    if spec is None:
        return None
    check_supported(config)
    states = MambaStates(model, spec, num_slots_for(config), dtype)
    log.info(
        "hybrid model: %d Mamba layers, %d attention layers; %d state slots (%.2f MiB)",
        len(spec.mamba_layers),
        len(spec.attn_layers),
        states.num_slots,
        states.nbytes / 2**20,
    )
    return states


# ---- where each sequence's tokens are in a step's flattened [rows * tokens] ----------------------------


def _longs(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.long)


def static_layout(step: StaticStep) -> MambaLayout:
    """Row r is slot r + 1. Prefill: row r's prompt is left-padded to the shape's prompt length."""
    shape: Shape = step.shape
    n = len(step.requests)
    if not step.is_prefill:
        return MambaLayout(torch.arange(n), torch.arange(1, n + 1))
    P = shape.prompt_len
    sequences = tuple(
        (torch.arange(r * P + P - req.num_prompt_tokens, (r + 1) * P), r + 1, True)
        for r, req in enumerate(step.requests)
    )
    return MambaLayout(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), sequences)


def continuous_layout(step: ContinuousStep, prefill_pieces: int) -> MambaLayout:
    """As step_inputs lays the step out: a chunk alone is left-padded to its bucket; a mixed step's region
    holds each piece's tokens but its last from the start, its last token at chunk_size + p, then the
    decode rows; a decode step is one token per row."""
    decode_base = step.chunk_size + prefill_pieces if step.mixed else 0
    rows = torch.arange(len(step.decode)) + decode_base
    slots = _longs(row.request.state_slot for row in step.decode)
    sequences, body = [], 0
    for p, chunk in enumerate(step.chunks):
        n = len(chunk.token_ids)
        if step.mixed:
            tokens = torch.cat([torch.arange(body, body + n - 1), _longs([step.chunk_size + p])])
            body += n - 1
        else:
            tokens = torch.arange(chunk.chunk_size - n, chunk.chunk_size)
        sequences.append((tokens, chunk.request.state_slot, chunk.start == 0))
    return MambaLayout(rows, slots, tuple(sequences))


def step_context(states: MambaStates | None, step, prefill_pieces: int):
    """Within: `step`'s layout for the Mamba layers (nothing for a model without them)."""
    if states is None:
        return contextlib.nullcontext()
    if isinstance(step, ContinuousStep):
        return step_layout(continuous_layout(step, prefill_pieces))
    return step_layout(static_layout(step))


def load_if_hybrid(config: RuntimeConfig, model: torch.nn.Module | None) -> torch.nn.Module | None:
    """`model` as given, or for a hybrid model folder the model loaded here (else None: loader.py loads)."""
    if model is not None:
        return model
    spec = HybridSpec.from_model_dir(config.model_dir)
    if spec is None:
        return None
    check_supported(config)
    return load_hybrid_model(config, spec, resolve_dtype(config.dtype, config.backend, config.model_dir))
