"""A step's input tensors: the scheduler's step description (steps.py) as the fixed shapes a compiled graph
was warmed for. Static batching left-pads prompts to the shape's length and fills the batch with dummy rows;
continuous batching lays out paged chunks, decode rows and mixed steps over the KV cache's block tables.
Dummy and pad positions write the scratch block and see one finite key; their outputs are dropped."""

from __future__ import annotations

from typing import NamedTuple

import torch

from spyre_runtime.config import RuntimeConfig, Shape
from spyre_runtime.executor.kv_cache import BLOCK_SIZE, SCRATCH_BLOCK, blocks_for
from spyre_runtime.request import Request
from spyre_runtime.steps import ContinuousStep, PrefillChunk, StaticStep


class TokenSpan(NamedTuple):
    """Tokens [start, start + length) of `request`'s sequence sit in row `row` of the step's input, from
    column `col` on (where an image-text model puts their image features: executor/families/vision.py)."""

    row: int
    col: int
    request: Request
    start: int
    length: int


class StepInputs:
    """Builds the positional arguments of ModelExecutor's forward for each kind of step."""

    def __init__(self, config: RuntimeConfig) -> None:
        self.prefill_pieces = config.prefill_pieces
        self.prefill_kv_len = max(config.kv_buckets)  # chunks see up to the longest KV bucket
        self.decode_table_width = blocks_for(config.max_model_len)  # blocks of the longest sequence

    def spans(self, step: StaticStep | ContinuousStep) -> tuple[TokenSpan, ...]:
        """Where each prompt token of the step sits in the layouts below (none for decode tokens)."""
        if isinstance(step, StaticStep):
            if not step.is_prefill:
                return ()
            P = step.shape.prompt_len
            return tuple(
                TokenSpan(r, P - q.num_prompt_tokens, q, 0, q.num_prompt_tokens)
                for r, q in enumerate(step.requests)
            )
        if not step.mixed:
            return tuple(
                TokenSpan(0, c.chunk_size - len(c.token_ids), c.request, c.start, len(c.token_ids))
                for c in step.chunks
            )
        out, body = [], 0
        for p, c in enumerate(step.chunks):  # the layout of `mixed`: bodies in order, last tokens at C + p
            n = len(c.token_ids)
            out += [
                TokenSpan(0, body, c.request, c.start, n - 1),
                TokenSpan(0, c.chunk_size + p, c.request, c.start + n - 1, 1),
            ]
            body += n - 1
        return tuple(out)

    # ---- static shapes ---------------------------------------------------------------------------

    @staticmethod
    def row_blocks(shape: Shape) -> torch.Tensor:
        """[B, nb]: row r owns blocks 1 + r*nb ... (one batch runs at a time, so shapes share them)."""
        nb = blocks_for(shape.max_len)
        return torch.arange(1, 1 + shape.batch_size * nb, dtype=torch.long).view(shape.batch_size, nb)

    def static_prefill(self, shape: Shape, prompts: list[list[int]]):
        """[B, P]: each prompt left-padded to the shape's prompt length, causal over its own tokens, written
        into its row's blocks."""
        B, P = shape.batch_size, shape.prompt_len
        ids = torch.zeros(B, P, dtype=torch.long)
        pos = torch.zeros(B, P, dtype=torch.long)
        slots = torch.full((B, P), SCRATCH_BLOCK * BLOCK_SIZE, dtype=torch.long)
        mask = torch.eye(P, dtype=torch.bool).expand(B, P, P).clone()
        causal = torch.ones(P, P, dtype=torch.bool).tril()
        logical = torch.arange(P)
        blocks = self.row_blocks(shape)
        for r, prompt in enumerate(prompts):
            n = len(prompt)
            pad = P - n
            ids[r, pad:] = torch.tensor(prompt, dtype=torch.long)
            pos[r, pad:] = torch.arange(n)
            slots[r] = blocks[r, logical // BLOCK_SIZE] * BLOCK_SIZE + logical % BLOCK_SIZE
            mask[r, pad:, pad:] = causal[pad:, pad:]
        return ids, pos, mask, slots

    def static_decode(self, shape: Shape, prompt_lens: list[int], last_tokens: list[int], t: int):
        """[B, 1]: decode step `t` after a prefill of `shape`; a row sees its prompt and the tokens since."""
        B, P = shape.batch_size, shape.prompt_len
        blocks = self.row_blocks(shape)
        nb = blocks.shape[1]
        K = nb * BLOCK_SIZE
        cur = P + t  # logical slot of this step's token
        ids = torch.zeros(B, 1, dtype=torch.long)
        pos = torch.zeros(B, 1, dtype=torch.long)
        slots = torch.full((B, 1), SCRATCH_BLOCK * BLOCK_SIZE, dtype=torch.long)
        mask = torch.zeros(B, 1, K, dtype=torch.bool)
        mask[:, 0, 0] = True  # dummy rows see one key of their own slab (finite: zeros or old keys)
        keys = torch.arange(K)
        for r, (n, token) in enumerate(zip(prompt_lens, last_tokens, strict=True)):
            ids[r, 0] = token
            pos[r, 0] = n + t
            slots[r, 0] = blocks[r, cur // BLOCK_SIZE] * BLOCK_SIZE + cur % BLOCK_SIZE
            mask[r, 0] = (keys >= P - n) & (keys <= cur)
        return ids, pos, mask, slots, None, int(blocks[0, 0])

    # ---- continuous batching: paged, bucketed shapes ---------------------------------------------

    def chunk(self, chunk: PrefillChunk, kv_len: int):
        """One request's prefill chunk, left-padded to `chunk.chunk_size` rows so its last token comes
        last; it attends to the request's earlier tokens through its block table (K = kv_len keys)."""
        C, n, start = chunk.chunk_size, len(chunk.token_ids), chunk.start
        nb = kv_len // BLOCK_SIZE
        pad = C - n
        table = torch.full((1, nb), SCRATCH_BLOCK, dtype=torch.long)
        table[0, : len(chunk.block_table)] = torch.tensor(chunk.block_table, dtype=torch.long)
        logical = torch.arange(start, start + n)
        ids = torch.zeros(1, C, dtype=torch.long)
        pos = torch.zeros(1, C, dtype=torch.long)
        slots = torch.full((1, C), SCRATCH_BLOCK * BLOCK_SIZE, dtype=torch.long)
        ids[0, pad:] = torch.tensor(chunk.token_ids, dtype=torch.long)
        pos[0, pad:] = logical
        slots[0, pad:] = table[0, logical // BLOCK_SIZE] * BLOCK_SIZE + logical % BLOCK_SIZE
        mask = torch.zeros(1, C, kv_len, dtype=torch.bool)
        mask[0, :pad, 0] = True  # pad rows see one finite key; their outputs are dropped
        mask[0, pad:] = torch.arange(kv_len)[None, :] <= logical[:, None]
        return ids, pos, mask, slots, table

    def batch_decode(self, step: ContinuousStep):
        """[batch_size, 1] decode of every running request: each row's block table (padded with scratch to
        the longest sequence's) and its length; the paged op reads each row's live slots (kv_cache.py).
        Dummy rows write scratch and see one scratch slot. The step's KV bucket plays no part."""
        B = step.batch_size
        n = len(step.decode)
        ids = torch.zeros(B, 1, dtype=torch.long)
        pos = torch.zeros(B, 1, dtype=torch.long)
        slots = torch.full((B, 1), SCRATCH_BLOCK * BLOCK_SIZE, dtype=torch.long)
        table = torch.full((B, self.decode_table_width), SCRATCH_BLOCK, dtype=torch.long)
        seq_lens = torch.ones(B, dtype=torch.long)
        if n:
            for r, row in enumerate(step.decode):
                table[r, : len(row.block_table)] = torch.tensor(row.block_table, dtype=torch.long)
            position = torch.tensor([row.position for row in step.decode])
            ids[:n, 0] = torch.tensor([row.token_id for row in step.decode])
            pos[:n, 0] = position
            slots[:n, 0] = table[torch.arange(n), position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
            seq_lens[:n] = position + 1
        return ids, pos, None, slots, table, None, seq_lens

    def mixed(self, step: ContinuousStep):
        """One row: the chunk region, then `batch_size` decode tokens. The region holds the step's pieces
        (`step.chunks`, up to P = `config.prefill_pieces` prompts): every token of a piece but its last one
        in order from the start, padded to the step's chunk bucket C, then the last token of piece p at
        C + p (P places), so the pieces' next-token logits are the forward's last P + B rows with the decode
        rows'. Each piece attends to its own request's slots (kv_cache.paged_prefill); the decode tokens as
        in a decode step."""
        P, C = self.prefill_pieces, step.chunk_size
        T = C + P
        ids = torch.zeros(T, dtype=torch.long)
        pos = torch.zeros(T, dtype=torch.long)
        slots = torch.full((T,), SCRATCH_BLOCK * BLOCK_SIZE, dtype=torch.long)
        token_piece = torch.full((T,), -1, dtype=torch.long)
        piece_tables = torch.full((P, self.decode_table_width), SCRATCH_BLOCK, dtype=torch.long)
        piece_lens = torch.zeros(P, dtype=torch.long)
        body = 0
        for p, chunk in enumerate(step.chunks):
            n = len(chunk.token_ids)
            piece_tables[p, : len(chunk.block_table)] = torch.tensor(chunk.block_table, dtype=torch.long)
            piece_lens[p] = chunk.start + n
            where = torch.cat([torch.arange(body, body + n - 1), torch.tensor([C + p])])
            logical = torch.arange(chunk.start, chunk.start + n)
            ids[where] = torch.tensor(chunk.token_ids, dtype=torch.long)
            pos[where] = logical
            slots[where] = piece_tables[p, logical // BLOCK_SIZE] * BLOCK_SIZE + logical % BLOCK_SIZE
            token_piece[where] = p
            body += n - 1
        d_ids, d_pos, _, d_slots, d_table, _, seq_lens = self.batch_decode(step)
        return (
            torch.cat([ids, d_ids.view(-1)])[None],
            torch.cat([pos, d_pos.view(-1)])[None],
            None,
            torch.cat([slots, d_slots.view(-1)])[None],
            d_table,
            None,
            seq_lens,
            True,
            piece_tables,
            piece_lens,
            token_piece,
            pos,
        )
