"""The KV-event gold payload regenerated (issue 37): vLLM 0.27.1's own event structs, read out of its wheel
(vllm/distributed/kv_events.py, through tests/runtime/vllm_reference.py as the metrics test reads vLLM's
files) and encoded with msgspec's msgpack encoder as vLLM's ZmqEventPublisher does, give the same bytes as
our encoder and as the checked-in payload (tests/runtime/data/vllm_0.27.1_kv_event_batch.json)."""

from __future__ import annotations

import ast
import sys
import types
from typing import Any

import msgspec
import pytest
from spyre_runtime.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch

from tests.runtime.vllm_reference import load_table, vllm_source

VLLM_STRUCTS = (
    "EventBatch",
    "KVCacheEvent",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KVEventBatch",
)


def vllm_kv_event_structs() -> dict[str, Any]:
    """vLLM's struct classes, executed from its own source: only those class statements (the module imports
    vLLM's config and logger), with its ExternalBlockHash alias from v1/core/kv_cache_utils.py."""
    alias = next(
        node.value
        for node in ast.parse(vllm_source("v1/core/kv_cache_utils.py").read_text()).body
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "ExternalBlockHash"
    )
    module = types.ModuleType("vllm_0_27_1_kv_events")  # msgspec resolves the annotations in the module
    sys.modules[module.__name__] = module
    namespace = module.__dict__
    namespace.update({"msgspec": msgspec, "Any": Any})
    namespace["ExternalBlockHash"] = eval(compile(ast.Expression(alias), "kv_cache_utils", "eval"), namespace)
    tree = ast.parse(vllm_source("distributed/kv_events.py").read_text())
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in VLLM_STRUCTS]
    assert sorted(c.name for c in classes) == sorted(VLLM_STRUCTS)
    exec(compile(ast.Module(classes, type_ignores=[]), "vllm/distributed/kv_events.py", "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def vllm():
    return vllm_kv_event_structs()


def test_vllms_encoder_writes_our_bytes_and_the_gold_payload(vllm):
    gold = load_table("kv_event_batch")
    ts = gold["batch"]["ts"]
    plain = {"lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0}  # as vLLM's block pool
    theirs = vllm["KVEventBatch"](
        ts=ts,
        events=[
            vllm["BlockStored"]([1, 2**64 - 1], None, list(range(128)), 64, extra_keys=[None, None], **plain),
            vllm["BlockStored"]([7], 2**64 - 1, list(range(300, 364)), 64, extra_keys=[None], **plain),
            vllm["BlockRemoved"]([1], medium="GPU", group_idx=0),
            vllm["AllBlocksCleared"](),
        ],
        data_parallel_rank=0,
    )
    payload = msgspec.msgpack.Encoder().encode(theirs)  # what vLLM's ZmqEventPublisher sends
    ours = encode_batch(
        ts,
        [
            BlockStored((1, 2**64 - 1), None, tuple(range(128)), 64),
            BlockStored((7,), 2**64 - 1, tuple(range(300, 364)), 64),
            BlockRemoved((1,)),
            AllBlocksCleared(),
        ],
    )
    assert ours == payload
    assert payload.hex() == gold["payload_hex"]  # the checked-in blob is what vLLM writes


def test_vllms_decoder_reads_our_batch(vllm):
    ours = encode_batch(1.5, [BlockStored((3, 4), 9, tuple(range(128)), 64), BlockRemoved((3,))])
    batch = msgspec.msgpack.Decoder(vllm["KVEventBatch"]).decode(ours)
    stored, removed = batch.events
    assert (batch.ts, batch.data_parallel_rank) == (1.5, 0)
    assert (stored.block_hashes, stored.parent_block_hash, stored.block_size) == ([3, 4], 9, 64)
    assert stored.token_ids == list(range(128)) and stored.medium == "GPU" and stored.group_idx == 0
    assert (removed.block_hashes, removed.medium) == ([3], "GPU")
