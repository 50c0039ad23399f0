"""Invalid and hostile SpyreModels, one table for the pure tests and the real control plane: each row is
(id, name, spec changes, what the condition must say, who catches it). `by`: "operator" (parse_spec and
the runtime's own contract), "server" (only the API server's dry run knows: admission, its validation)."""

BASE = {
    "model": {"source": "pvc://models/tiny"},
    "cards": 1,
    "replicas": 1,
    "backend": "inductor",
    "batching": {"mode": "static", "shapes": [{"promptLength": 64, "newTokens": 20, "batchSize": 1}]},
}
CB = {"mode": "continuous", "maxNumSeqs": 4, "maxModelLen": 256}
LLAMA_70B = {
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 28672,
    "vocab_size": 128256,
}

CATALOG = [
    ("requests-not-a-map", "m", {"resources": {"requests": "8"}}, "spec.resources.requests", "operator"),
    ("memory-lots", "m", {"resources": {"limits": {"memory": "lots"}}}, "'lots'", "operator"),
    ("env-value-number", "m", {"env": [{"name": "FOO", "value": 1}]}, "must be a string", "operator"),
    ("env-bad-name", "m", {"env": [{"name": "1 BAD", "value": "x"}]}, "not a valid environment", "operator"),
    (
        "env-twice",
        "m",
        {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]},
        "set twice",
        "operator",
    ),
    (
        "toleration-exists-value",
        "m",
        {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]},
        "must be empty when operator is 'Exists'",
        "operator",
    ),
    (
        "toleration-bad-op",
        "m",
        {"tolerations": [{"key": "k", "operator": "Maybe"}]},
        "Equal or Exists",
        "operator",
    ),
    ("missing-priority-class", "m", {"priorityClassName": "no-such-class"}, "no-such-class", "server"),
    ("name-with-dots", "my.model", {}, "must be a DNS label", "operator"),
    ("name-too-long", "m" * 64, {}, "64 characters", "operator"),
    ("cache-size-zero", "m", {"graphCache": {"size": "0"}}, "larger than zero", "operator"),
    ("node-selector-space", "m", {"nodeSelector": {"bad key": "x"}}, "not a valid label key", "operator"),
    ("node-selector-value", "m", {"nodeSelector": {"k": "a b"}}, "not a valid label value", "operator"),
    (
        "malformed-affinity",
        "m",
        {
            "affinity": {
                "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}
            }
        },
        "nodeSelectorTerms",
        "server",
    ),
    (
        "chunk-above-max-model-len",
        "m",
        {"batching": {**CB, "maxNumBatchedTokens": 512}},
        "larger than spec.batching.maxModelLen",
        "operator",
    ),
    (
        "env-backend-nonsense",
        "m",
        {"env": [{"name": "SENDNN_INFERENCE_DYNAMO_BACKEND", "value": "nonsense"}]},
        "SENDNN_INFERENCE_DYNAMO_BACKEND='nonsense'",
        "operator",
    ),
    (
        "env-warmup-lists-differ",
        "m",
        {"env": [{"name": "SENDNN_INFERENCE_WARMUP_BATCH_SIZES", "value": "1,2"}]},
        "warmup lists differ",
        "operator",
    ),
    (
        "env-use-cb-maybe",
        "m",
        {"env": [{"name": "SENDNN_INFERENCE_USE_CB", "value": "maybe"}]},
        "is not a boolean",
        "operator",
    ),
    (
        "env-kv-bucket-too-small",
        "m",
        {"batching": CB, "env": [{"name": "SENDNN_INFERENCE_CB_KV_LENS", "value": "64,128"}]},
        "below spec.batching.maxModelLen",
        "operator",
    ),
    (
        "kv-range-too-short",
        "m",
        {"batching": {**CB, "kvBuckets": {"min": 64, "step": 64, "max": 128}}},
        "below spec.batching.maxModelLen",
        "operator",
    ),
    (
        "too-large-for-one-card",
        "m",
        {"backend": "sendnn", "model": {"source": "pvc://models/big", "config": LLAMA_70B}},
        "the memory plan does not fit",
        "operator",
    ),
    ("cards-three", "m", {"cards": 3}, "must be one of 1, 2, 4, 8", "operator"),
    ("replicas-string", "m", {"replicas": "2"}, "must be an integer", "operator"),
    ("dtype-int8", "m", {"dtype": "int8"}, "spec.dtype", "operator"),
    ("suspend-string", "m", {"suspend": "yes"}, "true or false", "operator"),
    ("rollout-negative", "m", {"rollout": {"maxSurge": -1}}, "spec.rollout.maxSurge", "operator"),
    (
        "rollout-percent",
        "m",
        {"rollout": {"maxUnavailable": "150%"}},
        "spec.rollout.maxUnavailable",
        "operator",
    ),
    ("source-s3", "m", {"model": {"source": "s3://bucket/x"}}, "pvc://CLAIM/PATH", "operator"),
    ("image-empty", "m", {"image": ""}, "spec.image", "operator"),
    (
        "resources-claims",
        "m",
        {"resources": {"claims": [{"name": "x"}]}},
        "spec.resources.claims",
        "operator",
    ),
    (
        "cpu-request-over-limit",
        "m",
        {"resources": {"requests": {"cpu": "4"}, "limits": {"cpu": "1"}}},
        "cpu",
        "server",
    ),
]
