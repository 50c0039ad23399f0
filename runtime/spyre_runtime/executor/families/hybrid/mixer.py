"""The Mamba-2 mixer's sequence part (causal conv and SSD scan) as an op opaque to the compiler, reading and
writing each sequence's state in its slot.

A Mamba layer of a hybrid model runs, inside the compiled forward: norm -> in_proj -> `mamba_mix` -> gated
norm -> out_proj. Everything but `mamba_mix` has the step's fixed shape. `mamba_mix` gets the step's tokens
flattened ([T, ...], T = rows * tokens of the step's graph) and learns which tokens belong to which sequence
from the step's `MambaLayout` (set around the step by the executor, `step_layout`), so one compiled graph
serves any mix of prompts, chunks and decode rows, and their lengths change from step to step with no
recompile (the way kv_cache's paged ops read their rows' lengths):

    layout.rows, layout.row_slots   [d]  decode rows: one token each, continuing slot row_slots[i]'s state
    layout.sequences                     (token indices in order, slot, fresh): a prompt or a chunk of one;
                                         fresh: it starts at position 0 (zero state), else it continues
                                         the slot's state (chunked prefill carries the state chunk to chunk)
    conv_state [S, conv_dim, K]          per slot: the last K inputs of the causal conv
    ssm_state  [S, heads, head_dim, N]   per slot: the SSM state

Tokens no sequence owns (padding, dummy rows) come out zero and touch no state. Slot 0 is scratch. The math
is Mamba-2's (HF transformers' and FMS's torch reference): conv, silu, dt = softplus(dt + dt_bias), the
chunked SSD scan starting from the slot's state, y + D * x; computed in float32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spyre_runtime.executor.ops import opaque_op


@dataclass(frozen=True)
class MambaLayout:
    rows: torch.Tensor  # [d] long
    row_slots: torch.Tensor  # [d] long
    sequences: tuple[tuple[torch.Tensor, int, bool], ...] = ()


EMPTY = MambaLayout(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
_layout: MambaLayout = EMPTY  # within `step_layout`: the running step's


@contextlib.contextmanager
def step_layout(layout: MambaLayout) -> Iterator[None]:
    """Within: the step whose tokens `layout` describes (outside: nothing is computed, as in warm-up)."""
    global _layout
    before, _layout = _layout, layout
    try:
        yield
    finally:
        _layout = before


def causal_conv(xbc: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias):
    """One sequence: xbc [n, C] new inputs, window [C, K] its last K inputs (zeros when fresh), weight
    [C, 1, K] -> (silu(conv) [n, C], the new window [C, K])."""
    kernel = weight.shape[-1]
    ext = torch.cat([window, xbc.t()], dim=1)  # [C, K + n]
    out = F.conv1d(ext[None, :, 1:], weight, bias, groups=weight.shape[0])[0]  # [C, n]
    return F.silu(out.t()), ext[:, -kernel:]


def ssd_scan(x, dt, A, B, C, state, chunk: int):
    """One sequence from `state`: x [n, H, P], dt [n, H] (discretized), A [H], B, C [n, H, N], state
    [H, P, N] -> (y [n, H, P] without the D skip, the final state). Chunks of `chunk` tokens: within one,
    the quadratic (attention-like) form; between them, the state carries."""
    ys = []
    for s in range(0, x.shape[0], chunk):
        xs, dts, Bs, Cs = x[s : s + chunk], dt[s : s + chunk], B[s : s + chunk], C[s : s + chunk]
        n = xs.shape[0]
        cs = (dts * A).cumsum(0)  # [n, H]
        causal = torch.ones(n, n, dtype=torch.bool).tril()[..., None]
        decay = torch.exp((cs[:, None] - cs[None]).masked_fill(~causal, float("-inf")))  # [i, j, H]
        scores = torch.einsum("ihn,jhn->ijh", Cs, Bs) * decay
        y = torch.einsum("ijh,jhp->ihp", scores, xs * dts[..., None])
        y = y + torch.einsum("ihn,hpn->ihp", Cs, state) * torch.exp(cs)[..., None]
        weights = torch.exp(cs[-1][None] - cs) * dts  # [n, H]
        state = state * torch.exp(cs[-1])[:, None, None] + torch.einsum("jh,jhp,jhn->hpn", weights, xs, Bs)
        ys.append(y)
    return torch.cat(ys), state


def ssm_step(x, dt, A, B, C, state):
    """Decode rows, one token each: x [d, H, P], dt [d, H], B, C [d, H, N], state [d, H, P, N] ->
    (y [d, H, P] without the D skip, the new state)."""
    state = state * torch.exp(dt * A)[..., None, None] + (dt[..., None] * x)[..., None] * B[:, :, None]
    return torch.einsum("dhpn,dhn->dhp", state, C), state


def _split(xbc: torch.Tensor, heads: int, head_dim: int, groups: int):
    """[n, conv_dim] -> x [n, H, P], B, C [n, H, N] (each group's B and C shared by its heads)."""
    n = xbc.shape[0]
    inner = heads * head_dim
    state_size = (xbc.shape[1] - inner) // (2 * groups)
    x, B, C = xbc.split([inner, groups * state_size, groups * state_size], dim=-1)
    B = B.reshape(n, groups, state_size).repeat_interleave(heads // groups, dim=1)
    C = C.reshape(n, groups, state_size).repeat_interleave(heads // groups, dim=1)
    return x.reshape(n, heads, head_dim), B, C


def _fake_mix(xbc, dt, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D, head_dim, *_):
    return xbc.new_empty(xbc.shape[0], dt.shape[1] * head_dim)


@opaque_op(
    "mamba_mix(Tensor xbc, Tensor dt, Tensor(a!) conv_state, Tensor(b!) ssm_state, Tensor conv_weight, "
    "Tensor? conv_bias, Tensor dt_bias, Tensor A_log, Tensor D, int head_dim, int groups, int chunk) "
    "-> Tensor",
    _fake_mix,
)
def mamba_mix(
    xbc, dt, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D, head_dim, groups, chunk
):
    """xbc [T, conv_dim], dt [T, H] (in_proj's parts) -> y [T, H * P] (before the gated norm); each
    sequence of the step's layout from and into its slot of conv_state, ssm_state (see the module)."""
    layout = _layout
    heads = dt.shape[1]
    out = torch.zeros(xbc.shape[0], heads, head_dim, dtype=torch.float32)
    A = -torch.exp(A_log.float())
    Df = D.float()[:, None]
    if layout.rows.numel():
        rows, slots = layout.rows, layout.row_slots
        window = torch.cat([conv_state.index_select(0, slots), xbc.index_select(0, rows)[..., None]], -1)
        window = window[..., 1:]
        conv = (window.float() * conv_weight[:, 0].float()).sum(-1)
        conv = F.silu(conv + conv_bias.float() if conv_bias is not None else conv)
        conv_state.index_copy_(0, slots, window.to(conv_state.dtype))
        x, B, C = _split(conv, heads, head_dim, groups)
        step_dt = F.softplus(dt.index_select(0, rows).float() + dt_bias.float())
        y, state = ssm_step(x, step_dt, A, B, C, ssm_state.index_select(0, slots).float())
        ssm_state.index_copy_(0, slots, state.to(ssm_state.dtype))
        out.index_copy_(0, rows, y + Df * x)
    for tokens, slot, fresh in layout.sequences:
        window, state = conv_state[slot], ssm_state[slot].float()
        if fresh:
            window, state = torch.zeros_like(window), torch.zeros_like(state)
        conv, window = causal_conv(xbc.index_select(0, tokens), window, conv_weight, conv_bias)
        x, B, C = _split(conv.float(), heads, head_dim, groups)
        seq_dt = F.softplus(dt.index_select(0, tokens).float() + dt_bias.float())
        y, state = ssd_scan(x, seq_dt, A, B, C, state, chunk)
        conv_state[slot] = window
        ssm_state[slot] = state.to(ssm_state.dtype)
        out.index_copy_(0, tokens, y + Df * x)
    return out.reshape(xbc.shape[0], -1).to(xbc.dtype)


def mamba_mix_stateless(xbc, dt, ssm, rows: int, tokens: int) -> torch.Tensor:
    """No cache (prompt logprobs, eager): every one of `rows` rows of `tokens` tokens a fresh sequence whose
    state is dropped. `ssm`: FMS's SSM module (its weights)."""
    states = _scratch_states(ssm, rows + 1, xbc.dtype)
    index = torch.arange(rows * tokens).view(rows, tokens)
    layout = MambaLayout(EMPTY.rows, EMPTY.row_slots, tuple((index[r], r + 1, True) for r in range(rows)))
    with step_layout(layout):
        return mamba_mix(xbc, dt, *states, *mixer_weights(ssm))


def mixer_weights(ssm) -> tuple:
    """FMS SSM module -> mamba_mix's weight arguments and its ints."""
    bias = ssm.conv1d.bias if ssm.use_conv_bias else None
    return (
        ssm.conv1d.weight,
        bias,
        ssm.dt_bias,
        ssm.A_log,
        ssm.D,
        ssm.head_dim,
        ssm.n_groups,
        ssm.chunk_size,
    )


def _scratch_states(ssm, slots: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    conv = torch.zeros(slots, ssm.conv_dim, ssm.conv_kernel_size, dtype=dtype)
    return conv, torch.zeros(slots, ssm.nheads, ssm.head_dim, ssm.ssm_state_size, dtype=dtype)
