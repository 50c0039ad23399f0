"""The spec parser: every rule names the field and the rule it breaks."""

from __future__ import annotations

import pytest
from spyre_operator.spec.model_spec import InvalidSpec

from tests.operator.objects import spec_of

EMBED = {
    "task": "embed",
    "cards": 1,
    "batching": {"mode": "static", "shapes": [{"promptLength": 64, "batchSize": 1}]},
}


@pytest.mark.parametrize(
    ("changes", "field", "rule"),
    [
        ({"model": {}}, "model.source", "is required"),
        (
            {"model": {"source": "http://hub/model"}},
            "model.source",
            "must be one of pvc://CLAIM/PATH, file:///PATH",
        ),
        ({"cards": 3}, "cards", "must be one of 1, 2, 4, 8"),
        ({"replicas": -1}, "replicas", "must be at least 0"),
        ({"backend": "cuda"}, "backend", "must be one of sendnn, inductor, eager"),
        ({"batching": {"mode": "dynamic"}}, "batching.mode", "must be static or continuous"),
        ({"batching": {"mode": "static", "shapes": []}}, "batching.shapes", "at least one shape"),
        (
            {
                "batching": {
                    "mode": "static",
                    "shapes": [{"promptLength": 100, "newTokens": 1, "batchSize": 1}],
                }
            },
            "batching.shapes[0].promptLength",
            "multiple of 64",
        ),
        (
            {
                "batching": {
                    "mode": "static",
                    "shapes": [{"promptLength": 64, "newTokens": 0, "batchSize": 1}],
                }
            },
            "batching.shapes[0].newTokens",
            "at least 1",
        ),
        (
            {"batching": {"mode": "continuous", "maxNumSeqs": 4}},
            "batching",
            "needs maxNumSeqs and maxModelLen",
        ),
        (
            {"batching": {"shapes": [{"promptLength": 64, "newTokens": 8, "batchSize": 1}]}},
            "batching",
            "continuous batching needs maxNumSeqs and maxModelLen (continuous is the default for generate "
            "models; batching.mode: static keeps sendnn-inference 1.x's warm-up shapes)",
        ),
        (
            {
                "batching": {
                    "mode": "continuous",
                    "maxNumSeqs": 4,
                    "maxModelLen": 256,
                    "maxNumBatchedTokens": 100,
                }
            },
            "batching.maxNumBatchedTokens",
            "multiple of 64",
        ),
        (
            {"graphCache": {"existingClaim": "c", "storageClassName": "nfs"}},
            "graphCache",
            "exclude each other",
        ),
        ({"graphCache": {"size": "lots"}}, "graphCache.size", "quantity"),
        ({"env": [{"value": "x"}]}, "env[0]", "must be an object with a name"),
        ({"dtype": "int8"}, "dtype", "must be one of auto, float32, bfloat16, float16, got 'int8'"),
        (
            {"kvCacheDtype": "fp8"},
            "kvCacheDtype",
            "must be one of auto, float32, bfloat16, float16, got 'fp8'",
        ),
        (
            {"backend": "sendnn", "kvCacheDtype": "bfloat16"},
            "kvCacheDtype",
            "must be auto or float16 with backend sendnn, got 'bfloat16': Spyre cards keep the KV cache in "
            "the model's float16",
        ),
        (
            {"backend": "sendnn_decoder", "kvCacheDtype": "float32"},  # the alias is sendnn
            "kvCacheDtype",
            "must be auto or float16 with backend sendnn, got 'float32'",
        ),
        (
            {"backend": "sendnn", "dtype": "bfloat16", "kvCacheDtype": "float16"},
            "kvCacheDtype",
            "must be auto or bfloat16 with backend sendnn, got 'float16': Spyre cards keep the KV cache in "
            "the model's bfloat16",
        ),
        (
            {**EMBED, "dtype": "float32", "kvCacheDtype": "bfloat16"},
            "kvCacheDtype",
            "'bfloat16' has no effect on a pooling model, which keeps no KV cache; leave it auto",
        ),
        (
            {**EMBED, "backend": "sendnn", "kvCacheDtype": "float16"},  # the model's own: still no cache
            "kvCacheDtype",
            "has no effect on a pooling model",
        ),
    ],
)
def test_every_rule_names_field_and_rule(changes, field, rule):
    with pytest.raises(InvalidSpec) as err:
        spec_of(**changes)
    assert err.value.field_path == field and rule in err.value.rule
    assert str(err.value).startswith(f"spec.{field}: ")


@pytest.mark.parametrize(
    ("changes", "kv_cache_dtype"),
    [
        ({}, "auto"),  # the model's dtype
        ({"dtype": "float32", "kvCacheDtype": "bfloat16"}, "bfloat16"),  # CPU backends may narrow the cache
        ({"backend": "eager", "kvCacheDtype": "float16"}, "float16"),
        ({"backend": "sendnn", "kvCacheDtype": "auto"}, "auto"),
        ({"backend": "sendnn", "kvCacheDtype": "float16"}, "float16"),  # dtype auto is float16 on Spyre
        ({"backend": "sendnn", "dtype": "bfloat16", "kvCacheDtype": "bfloat16"}, "bfloat16"),
        ({**EMBED, "kvCacheDtype": "auto"}, "auto"),  # a pooling model keeps no KV cache
    ],
)
def test_the_kv_cache_dtypes_each_backend_takes(changes, kv_cache_dtype):
    assert spec_of(**changes).kv_cache_dtype == kv_cache_dtype
