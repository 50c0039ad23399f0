"""The elementwise rotary embedding (executor/rotary.py) against FMS's own, on a table of layouts: the same
numbers, bit for bit in eager mode, and compiled by inductor within float rounding."""

from __future__ import annotations

import pytest
import torch
from fms.modules.positions import RotaryEmbedding
from spyre_runtime.executor.rotary import PairwiseRotary, rotary_encoders, use_pairwise_rotary


class Holder(torch.nn.Module):
    """As an FMS model holds its rotary embedding (not a module): an attribute of a module."""

    def __init__(self, encoder: RotaryEmbedding, name: str = "rot_emb") -> None:
        super().__init__()
        setattr(self, name, encoder)


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}

# (name, head_dim, q heads, kv heads, rows, tokens, first positions of the rows, dtype, scaling)
CASES = [
    ("one-token-decode-rows", 64, 9, 3, 8, 1, (5, 0, 383, 17, 2, 99, 1023, 40), torch.float32, {}),
    ("prompt-chunk", 64, 9, 3, 1, 72, (0,), torch.float32, {}),
    ("chunk-late-in-a-prompt", 64, 9, 3, 1, 40, (700,), torch.float32, {}),
    ("mha-head-128", 128, 4, 4, 2, 9, (3, 300), torch.float32, {}),
    ("bfloat16", 64, 9, 3, 4, 5, (0, 7, 63, 500), torch.bfloat16, {}),
    ("llama3-scaling", 64, 8, 2, 2, 6, (10, 900), torch.float32, LLAMA3),
]


def rotaries(head_dim: int, scaling: dict) -> tuple[RotaryEmbedding, RotaryEmbedding]:
    fms = RotaryEmbedding(head_dim, ratio=100_000.0, max_seq_len=1024, scaling=scaling)
    ours = RotaryEmbedding(head_dim, ratio=100_000.0, max_seq_len=1024, scaling=scaling)
    assert use_pairwise_rotary(Holder(ours)) == 1 and isinstance(ours, PairwiseRotary)
    for rope in (fms, ours):
        rope.compute_freqs_cis(torch.device("cpu"), 2048)
    return fms, ours


def inputs(heads, kvheads, head_dim, rows, tokens, starts, dtype):
    gen = torch.Generator().manual_seed(rows * 1000 + tokens)
    q = torch.randn(rows, tokens, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(rows, tokens, kvheads, head_dim, generator=gen).to(dtype)
    positions = torch.tensor(starts).unsqueeze(1) + torch.arange(tokens)
    return q, k, positions


@pytest.mark.parametrize(
    ("head_dim", "heads", "kvheads", "rows", "tokens", "starts", "dtype", "scaling"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_the_elementwise_rotation_is_fms_own(head_dim, heads, kvheads, rows, tokens, starts, dtype, scaling):
    fms, ours = rotaries(head_dim, scaling)
    q, k, positions = inputs(heads, kvheads, head_dim, rows, tokens, starts, dtype)
    want_q, want_k = fms.adjusted_qk(q, k, positions)
    got_q, got_k = ours.adjusted_qk(q, k, positions)
    assert got_q.dtype == dtype and got_q.shape == q.shape and got_k.shape == k.shape
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)  # eager: the same arithmetic
    compiled = torch.compile(ours.adjusted_qk, backend="inductor", fullgraph=True, dynamic=False)
    cq, ck = compiled(q, k, positions)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(cq, want_q, rtol=tol, atol=tol)
    torch.testing.assert_close(ck, want_k, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("why", "kwargs", "scaling"),
    [
        ("partial rotation", {"partial_rope": 0.5}, {}),
        ("yarn", {}, {"rope_type": "yarn", "scaling_factor": 4.0, "ntk_alpha": 1.0, "ntk_beta": 32.0}),
    ],
)
def test_what_it_does_not_rewrite_is_left_to_fms(why, kwargs, scaling):
    """A partial or YaRN rotation runs FMS's method unchanged; so does a call without position ids."""
    fms = RotaryEmbedding(64, max_seq_len=1024, scaling=scaling, **kwargs)
    ours = RotaryEmbedding(64, max_seq_len=1024, scaling=scaling, **kwargs)
    use_pairwise_rotary(Holder(ours))
    q, k, positions = inputs(4, 2, 64, 2, 3, (0, 50), torch.float32)
    for pos in (positions, None):
        want = fms.adjusted_qk(q, k, pos)
        got = ours.adjusted_qk(q, k, pos)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), why


def test_only_fms_own_rotary_class_is_swapped():
    """A subclass (another family's own rotation, e.g. a vision tower's) is never given the rewrite."""

    class Other(RotaryEmbedding):
        pass

    plain, other = RotaryEmbedding(64), Other(64)
    model = torch.nn.ModuleList([Holder(plain), Holder(other), Holder(plain, name="position_encoder")])
    assert rotary_encoders(model) == [plain, other]  # each encoder once, however many layers hold it
    assert use_pairwise_rotary(model) == 1
    assert type(plain) is PairwiseRotary and type(other) is Other
    assert use_pairwise_rotary(model) == 0  # twice is once
