"""The memory plan at start-up counts what this CPU's linear layers keep beside their weights
(linear.weight_routing): a copy packed for oneDNN only where oneDNN packs the model's dtype (bfloat16 needs
AVX-512 or AVX-NE-CONVERT), panels where the row linear runs, neither for float16, which keeps ATen's GEMM.
The plan's own arithmetic for each routing is in tests/test_contract.py."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from spyre_runtime import cli
from spyre_runtime.config import check_memory, load_config
from spyre_runtime.executor import linear

CB = {"SENDNN_INFERENCE_DYNAMO_BACKEND": "eager", "SENDNN_INFERENCE_USE_CB": "1"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_routing_is_what_the_packed_op_really_keeps(dtype):
    """The routing agrees with the entry the packed op really makes: a oneDNN tensor exactly when it says
    packed, the plain weight itself when it says plain; float16 never goes through the op."""
    kind = getattr(torch, dtype)
    routing = linear.weight_routing(dtype, "inductor")
    packs = linear.can_pack(kind, "inductor")
    assert routing == ("none" if dtype == "float16" else "packed" if packs else "plain")
    if routing != "none":
        weight = torch.randn(16, 32, dtype=kind)
        entry = linear.packed_copy(weight, 8)
        assert entry.is_mkldnn is (routing == "packed")
        assert routing == "packed" or entry.data_ptr() == weight.data_ptr()
    assert linear.weight_routing(dtype, "sendnn") == "none"


@pytest.mark.parametrize("name", ["float8_e9m9", "Tensor", ""])
def test_a_dtype_name_torch_does_not_know_counts_the_most(name):
    assert linear.weight_routing(name, "inductor") == "packed"


def plan_table(caplog, check, config) -> str:
    with caplog.at_level(logging.INFO, logger="spyre_runtime.config"):
        check(config)
    table = "\n".join(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory plan"))
    caplog.clear()
    assert "total" in table
    return table


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_plan_at_start_up_counts_a_packed_copy_only_where_one_is_made(tiny_model, dtype, caplog):
    """The CLI's check (serve, compile, generate) asks the executor; config's own, given no routing (it
    may not import the executor), counts the most, as the operator does."""
    config = dataclasses.replace(load_config(tiny_model, environ=CB), dtype=dtype)
    table = plan_table(caplog, cli._check_memory, config)
    routing = linear.weight_routing(dtype, config.backend)
    assert ("weights packed for oneDNN (CPU)" in table) is (routing == "packed")
    assert ("weights in panels for few rows (CPU)" in table) is (routing != "none")
    most = plan_table(caplog, check_memory, config)
    assert "weights packed for oneDNN (CPU)" in most and "weights in panels for few rows (CPU)" in most
