"""The environment contract (spyre_contract), pure: bucket ranges with Gaudi's ramp-up rule (its documented
examples as rows), lists and ranges exclusive, the older backend spelling, the rules that tie variables to
flags. The runtime reads its settings with these rules and the operator checks pods with them."""

from __future__ import annotations

import logging

import pytest
from spyre_contract import ContractError, EngineFlags, expand_range, read_environment


@pytest.mark.parametrize(
    ("bmin", "step", "bmax", "expected"),
    [
        # Gaudi's documented examples: batch sizes 1,32,64; prompt lengths 128,128,512
        (1, 32, 64, (1, 2, 4, 8, 16, 32, 64)),
        (128, 128, 512, (128, 256, 384, 512)),
        (2, 32, 64, (2, 4, 8, 16, 32, 64)),
        (1, 4, 16, (1, 2, 4, 8, 12, 16)),
        (64, 128, 384, (64, 128, 256, 384)),
        (4, 4, 4, (4,)),
    ],
)
def test_expand_range_ramps_up_in_powers_of_two_then_steps(bmin, step, bmax, expected):
    assert expand_range(bmin, step, bmax) == expected


CB = {"SENDNN_INFERENCE_USE_CB": "1"}
FLAGS = EngineFlags(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256)


def test_ranges_reach_the_engine_menu():
    s = read_environment(
        {
            **CB,
            "SENDNN_INFERENCE_CB_DECODE_BATCH_BUCKETS": "1,4,8",
            "SENDNN_INFERENCE_CB_KV_BUCKETS": "128,128,512",
            "SENDNN_INFERENCE_CB_PREFILL_BUCKETS": "64,128,256",
        },
        FLAGS,
    )
    assert s.decode_batch_buckets == (1, 2, 4, 8)
    assert s.kv_len_buckets == (128, 256, 384, 512)
    assert s.prefill_buckets == (64, 128, 256)


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        (
            {"SENDNN_INFERENCE_CB_KV_BUCKETS": "64,128,512", "SENDNN_INFERENCE_CB_KV_LENS": "512"},
            "exclude each other",
        ),
        ({"SENDNN_INFERENCE_CB_KV_BUCKETS": "64,512"}, "must be min,step,max"),
        ({"SENDNN_INFERENCE_CB_KV_BUCKETS": "512,64,128"}, "min 512 is above max 128"),
        ({"SENDNN_INFERENCE_CB_KV_BUCKETS": "100,100,500"}, "not a multiple of 64"),
        ({"SENDNN_INFERENCE_CB_KV_BUCKETS": "64,64,256"}, "below --max-model-len=512"),
        ({"SENDNN_INFERENCE_CB_DECODE_BATCH_BUCKETS": "1,2,4"}, "below --max-num-seqs=8"),
        ({"SENDNN_INFERENCE_CB_PREFILL_BUCKETS": "64,64,128"}, "below --max-num-batched-tokens=256"),
        ({"SENDNN_INFERENCE_DYNAMO_BACKEND": "cuda"}, "SENDNN_INFERENCE_DYNAMO_BACKEND='cuda'"),
        ({"SENDNN_INFERENCE_DTYPE": "int4"}, "SENDNN_INFERENCE_DTYPE='int4'"),
    ],
)
def test_bad_settings_name_the_variable(env, needle):
    with pytest.raises(ContractError, match=None) as err:
        read_environment({**CB, **env}, FLAGS)
    assert needle in str(err.value)


def test_chunk_larger_than_max_model_len_is_refused_only_when_asked_for():
    with pytest.raises(ContractError, match="larger than --max-model-len=128"):
        read_environment(CB, EngineFlags(max_model_len=128, max_num_batched_tokens=256))
    assert read_environment(CB, EngineFlags(max_model_len=128)).max_num_batched_tokens == 256


def test_older_backend_spelling_is_an_alias_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        s = read_environment({"SENDNN_INFERENCE_DYNAMO_BACKEND": "sendnn_decoder"})
    assert s.backend == "sendnn"
    assert any("sendnn_decoder is deprecated" in r.getMessage() for r in caplog.records)
    assert s.deprecated_env == ("SENDNN_INFERENCE_DYNAMO_BACKEND=sendnn_decoder",)
    old = read_environment({"VLLM_SPYRE_DYNAMO_BACKEND": "eager"})
    assert old.backend == "eager" and old.deprecated_env == ("VLLM_SPYRE_DYNAMO_BACKEND",)
