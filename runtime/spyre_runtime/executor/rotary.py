"""FMS's rotary embedding in a form inductor compiles into a vector loop.

FMS 1.13.1 rotates each pair (x0, x1) of a head by multiplying it with a 2 x 2 matrix gathered by position and
summing over the pair (`RotaryEmbedding.adjusted_qk`: `freqs[pos] * x.view(..., D/2, 1, 2)`, then
`.sum(5)`). Inductor fuses that, with the KV cache's store, into a loop whose inner dimensions have size 2: it
does not vectorize it. Profiled in a mixed step of 64 prompt tokens on SmolLM2 (2 threads, AVX-512): that one
kernel took 5.7 ms of the step's 66 (190 us a layer), and it grows with the tokens. The same rotation written
elementwise, `(cos x0 - sin x1, sin x0 + cos x1)` with cos and sin read from FMS's own table at the same
positions, took 0.64 ms (bench/README.md, run 31). The arithmetic is FMS's: the same products of the same
float32 numbers, summed in the same order.

Only the regular rotation of the whole head is rewritten; YaRN scaling, a partial rotation (`partial_rope`)
and calls without position ids keep FMS's own method."""

from __future__ import annotations

import torch
from fms.modules.positions import RotaryEmbedding


class PairwiseRotary(RotaryEmbedding):
    """A RotaryEmbedding whose adjusted_qk rotates the pairs elementwise (see the module)."""

    def adjusted_qk(self, q, k, position_ids=None, past_kv_state=None, use_cache=False):
        if position_ids is None or self.rope_type == "yarn" or self.partial_rope != 1.0:
            return super().adjusted_qk(q, k, position_ids, past_kv_state, use_cache)
        seq_len = max(k.size(1), q.size(1))
        alpha = self.compute_freqs_cis(q.device, torch.max(position_ids[:, 0]) + seq_len)
        # FMS's table holds [[cos, -sin], [sin, cos]] per position and pair: B x L x D/2 x 2 x 2
        freqs = self.cached_freqs[q.device.index][alpha][position_ids].float()
        return _rotate(q, freqs), _rotate(k, freqs)


def _rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x [B, L, H, D] rotated by the last L positions of `freqs` [B, L', D/2, 2, 2]."""
    pairs = x.float().view(*x.size()[:-1], -1, 2)
    table = freqs.narrow(1, freqs.size(1) - x.size(1), x.size(1)).unsqueeze(2)  # B L 1 D/2 2 2
    x0, x1 = pairs[..., 0], pairs[..., 1]
    # FMS's sum over the pair: row 0 is cos * x0 + (-sin) * x1, row 1 is sin * x0 + cos * x1
    first = table[..., 0, 0] * x0 + table[..., 0, 1] * x1
    second = table[..., 1, 0] * x0 + table[..., 1, 1] * x1
    return torch.stack((first, second), dim=-1).flatten(3).type_as(x)


def rotary_encoders(model: torch.nn.Module) -> list[RotaryEmbedding]:
    """The model's rotary embeddings, each once. FMS's position encoders are not modules: a model holds
    one (`rot_emb`) and hands it to every attention layer (`position_encoder`)."""
    found: dict[int, RotaryEmbedding] = {}
    for module in model.modules():
        for name in ("rot_emb", "position_encoder"):
            encoder = getattr(module, name, None)
            if isinstance(encoder, RotaryEmbedding):
                found.setdefault(id(encoder), encoder)
    return list(found.values())


def use_pairwise_rotary(model: torch.nn.Module) -> int:
    """Gives every plain RotaryEmbedding of `model` PairwiseRotary's adjusted_qk (a subclass, e.g. another
    family's own rotation, is left alone); returns how many were changed."""
    swapped = 0
    for encoder in rotary_encoders(model):
        if type(encoder) is RotaryEmbedding:
            encoder.__class__ = PairwiseRotary
            swapped += 1
    return swapped
