"""Invalid and hostile SpyreModels, one table for every place that refuses them: the operator's own checks
(pure tests), the 1.20 control plane (which enforces the CRD's plain OpenAPI schema but ignores its CEL rules,
so the operator refuses the rest) and a current API server (the 1.36 CRD server, which refuses at create time
whatever the schema or a CEL rule expresses).

Each row says what the model's condition must say on a cluster that ignores CEL (`needle`), who says it there
(`by`: "operator" for parse_spec and the runtime's own contract, "server" for the API server's dry run of the
pod), what a current cluster answers when the model is created (`at_create`, "" when it accepts the model and
leaves it to the operator), and whether that refusal is a plain schema keyword, which the 1.20 API server
enforces too (`schema`: then the model never reaches the operator there; `legacy` when 1.20 refuses it in
words of its own)."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field

BASE = {
    "model": {"source": "pvc://models/tiny"},
    "cards": 1,
    "replicas": 1,
    "backend": "inductor",
    "batching": {"mode": "static", "shapes": [{"promptLength": 64, "newTokens": 20, "batchSize": 1}]},
}


def model_object(name: str = "granite", **spec) -> dict:
    """A SpyreModel object as the API server gives it to the operator: BASE's spec, `spec` over it."""
    return {
        "apiVersion": "spyre-serve.io/v1alpha1",
        "kind": "SpyreModel",
        "metadata": {"name": name, "namespace": "ml", "uid": "u-1", "generation": 1},
        "spec": {**copy.deepcopy(BASE), **spec},
    }


KEY_AUTH = {"apiKey": {"secretRef": {"name": "model-key", "key": "api-key"}}}
CB = {"mode": "continuous", "maxNumSeqs": 4, "maxModelLen": 256}
POOLING_SHAPES = [{"promptLength": 64, "batchSize": 4}]
LLAMA_70B = {
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 28672,
    "vocab_size": 128256,
}


@dataclass(frozen=True)
class Row:
    id: str
    changes: dict
    needle: str  # in the condition on a cluster that ignores CEL (the operator's InvalidSpec)
    at_create: str = ""  # in a current API server's refusal at create time; "": it accepts the model
    by: str = "operator"  # "operator" (its own checks) or "server" (the API server's dry run of the pod)
    schema: bool = False  # the refusal at create is a plain OpenAPI keyword: the 1.20 server refuses it too
    legacy: str = ""  # what the 1.20 server answers at create, when its words differ from at_create's
    name: str = "m"
    spec: dict = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "spec", {**BASE, **self.changes})

    @property
    def refused_by_legacy_server(self) -> str:
        """What the 1.20 API server answers at create time ("": it accepts the model); it names a list
        item's field without its index (spec.env.value)."""
        return self.legacy or (re.sub(r"\[\d+\]", "", self.at_create) if self.schema else "")

    @property
    def model_name(self) -> str:
        """The model's name in a namespace shared by every row."""
        return self.id if self.name == "m" else self.name


CATALOG = [
    # resources: a map of quantities, cards only through spec.cards
    Row(
        "requests-not-a-map",
        {"resources": {"requests": "8"}},
        "spec.resources.requests",
        at_create="spec.resources.requests in body must be of type object",
        schema=True,
    ),
    Row(
        "memory-lots",
        {"resources": {"limits": {"memory": "lots"}}},
        "'lots'",
        at_create="spec.resources.limits: Invalid value: every amount must be a quantity",
    ),
    Row(
        "resources-claims",
        {"resources": {"claims": [{"name": "x"}]}},
        "spec.resources.claims",
        at_create="spec.resources.claims: Invalid value: is not supported",
    ),
    Row(
        "cpu-request-over-limit",
        {"resources": {"requests": {"cpu": "4"}, "limits": {"cpu": "1"}}},
        "cpu",
        at_create="spec.resources.requests: Invalid value: a request is above its limit",
        by="server",
    ),
    Row(
        "card-limit-differs-from-cards",
        {"resources": {"limits": {"ibm.com/spyre_pf": "2"}}},
        "spec.resources.limits.ibm.com/spyre_pf: asks for 2 cards but spec.cards is 1",
        at_create="spec.resources: Invalid value: a card count in requests or limits differs from spec.cards",
    ),
    Row(
        "card-request-differs-from-cards",
        {"cards": 2, "resources": {"requests": {"ibm.com/spyre_vf": 4}}},
        "spec.resources.requests.ibm.com/spyre_vf: asks for 4 cards but spec.cards is 2",
        at_create="a card count in requests or limits differs from spec.cards",
    ),
    Row(
        "card-limit-beside-devices",
        {"devices": {}, "resources": {"limits": {"ibm.com/spyre_pf": "1"}}},
        "spec.resources.limits.ibm.com/spyre_pf: asks for cards by extended resource while spec.devices",
        at_create="spec.resources: Invalid value: asks for cards by extended resource while spec.devices",
    ),
    Row(
        "devices-and-card-resource",
        {"devices": {"deviceClassName": "spyre-pf"}, "cardResource": "ibm.com/spyre_vf"},
        "spec.devices.deviceClassName and spec.cardResource exclude each other",
        at_create=(
            "spec.devices: Invalid value: "
            "spec.devices.deviceClassName and spec.cardResource exclude each other"
        ),
    ),
    Row(
        "card-resource-not-a-name",
        {"cardResource": "spyre cards"},
        "spec.cardResource: 'spyre cards' is not an extended resource name",
        at_create='spec.cardResource: Invalid value: "spyre cards": must be an extended resource name',
    ),
    # env: Kubernetes' EnvVar, and the runtime's contract on the variables the operator sets
    Row(
        "env-value-number",
        {"env": [{"name": "FOO", "value": 1}]},
        "must be a string",
        at_create="spec.env[0].value in body must be of type string",
        schema=True,
    ),
    Row(
        "env-bad-name",
        {"env": [{"name": "1 BAD", "value": "x"}]},
        "not a valid environment",
        at_create="'1 BAD' is not a valid environment variable name",
    ),
    Row(
        "env-twice",
        {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]},
        "set twice",
        at_create="spec.env: Invalid value: a variable is set twice",
    ),
    Row(
        "env-value-and-value-from",
        {"env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]},
        "value and valueFrom exclude each other",
        at_create="A: value and valueFrom exclude each other",
    ),
    Row(
        "env-backend-nonsense",
        {"env": [{"name": "SENDNN_INFERENCE_DYNAMO_BACKEND", "value": "nonsense"}]},
        "SENDNN_INFERENCE_DYNAMO_BACKEND='nonsense'",
        at_create="SENDNN_INFERENCE_DYNAMO_BACKEND='nonsense' is not one of sendnn, inductor, eager",
    ),
    Row(
        "env-warmup-lists-differ",
        {"env": [{"name": "SENDNN_INFERENCE_WARMUP_BATCH_SIZES", "value": "1,2"}]},
        "warmup lists differ",
        at_create="spec.env: Invalid value: warmup lists differ in length",
    ),
    Row(
        "env-use-cb-maybe",
        {"env": [{"name": "SENDNN_INFERENCE_USE_CB", "value": "maybe"}]},
        "is not a boolean",
        at_create="SENDNN_INFERENCE_USE_CB='maybe' is not a boolean",
    ),
    Row(  # a runtime switch the admission rules leave to the operator's run of the contract
        "env-row-linear-sometimes",
        {"env": [{"name": "SENDNN_INFERENCE_ROW_LINEAR", "value": "sometimes"}]},
        "SENDNN_INFERENCE_ROW_LINEAR='sometimes' is not a boolean",
    ),
    Row(  # a bucket list's numbers against the limits: beyond what CEL's cost budget allows per env entry
        "env-kv-bucket-too-small",
        {"batching": CB, "env": [{"name": "SENDNN_INFERENCE_CB_KV_LENS", "value": "64,128"}]},
        "below spec.batching.maxModelLen",
    ),
    # placement
    Row(
        "toleration-exists-value",
        {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]},
        "must be empty when operator is 'Exists'",
        at_create="value must be empty when operator is 'Exists'",
    ),
    Row(
        "toleration-bad-op",
        {"tolerations": [{"key": "k", "operator": "Maybe"}]},
        "Equal or Exists",
        at_create="operator must be Equal or Exists, got 'Maybe'",
    ),
    Row(
        "toleration-bad-effect",
        {"tolerations": [{"key": "k", "operator": "Exists", "effect": "Sometimes"}]},
        "is not a taint effect",
        at_create="effect is not a taint effect: 'Sometimes'",
    ),
    Row(
        "node-selector-space",
        {"nodeSelector": {"bad key": "x"}},
        "not a valid label key",
        at_create="spec.nodeSelector: Invalid value: every key must be a valid label key",
    ),
    Row(
        "node-selector-value",
        {"nodeSelector": {"k": "a b"}},
        "not a valid label value",
        at_create="spec.nodeSelector: Invalid value: every value must be a valid label value",
    ),
    Row(
        "scheduler-name-not-dns",
        {"schedulerName": "Spyre Scheduler"},
        "spec.schedulerName: must be a DNS name",
        at_create='spec.schedulerName: Invalid value: "Spyre Scheduler": must be a DNS name',
    ),
    Row("missing-priority-class", {"priorityClassName": "no-such-class"}, "no-such-class", by="server"),
    Row(
        "malformed-affinity",
        {
            "affinity": {
                "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}
            }
        },
        "nodeSelectorTerms",
        by="server",
    ),
    # the name becomes a Service name and a label value
    Row(
        "name-with-dots",
        {},
        "must be a DNS label",
        at_create="metadata.name: Invalid value: must be a DNS label",
        name="my.model",
    ),
    Row(
        "name-too-long",
        {},
        "64 characters",
        at_create="metadata.name: Invalid value: at most 63 characters fit a Service name",
        name="m" * 64,
    ),
    # the graph cache
    Row(
        "cache-size-zero",
        {"graphCache": {"size": "0"}},
        "larger than zero",
        at_create='spec.graphCache.size: Invalid value: "0": must be larger than zero, got 0',
    ),
    Row(
        "cache-claim-not-dns",
        {"graphCache": {"existingClaim": "Graph_Cache"}},
        "spec.graphCache.existingClaim: must be a DNS name",
        at_create='spec.graphCache.existingClaim: Invalid value: "Graph_Cache": must be a DNS name',
    ),
    # batching: shapes per task, continuous batching's limits and bucket ranges
    # a step's chunk holds pieces of up to 4 prompts (SENDNN_INFERENCE_CB_PREFILL_PIECES), maxNumSeqs when
    # fewer; the CRD knows only maxNumSeqs (spec.env can raise the pieces up to it), the operator knows both
    Row(
        "chunk-above-max-num-seqs-prompts",
        {"batching": {**CB, "maxNumBatchedTokens": 1088}},
        "larger than 4 prompt(s) of spec.batching.maxModelLen=256",
        at_create="spec.batching.maxNumBatchedTokens: Invalid value: the runtime would refuse it: the chunk",
    ),
    Row(
        "chunk-above-the-prefill-pieces",
        {"batching": {**CB, "maxNumSeqs": 8, "maxNumBatchedTokens": 1280}},
        "larger than 4 prompt(s) of spec.batching.maxModelLen=256",
    ),
    Row(
        "kv-range-too-short",
        {"batching": {**CB, "kvBuckets": {"min": 64, "step": 64, "max": 128}}},
        "below spec.batching.maxModelLen",
        at_create="spec.batching.kvBuckets: Invalid value: the runtime would refuse it: the largest KV",
    ),
    Row(
        "decode-range-too-short",
        {"batching": {**CB, "maxNumSeqs": 8, "decodeBatchBuckets": {"min": 1, "step": 2, "max": 4}}},
        "below spec.batching.maxNumSeqs",
        at_create="spec.batching.decodeBatchBuckets: Invalid value: the runtime would refuse it",
    ),
    Row(
        "prefill-range-below-chunk",
        {"batching": {**CB, "prefillBuckets": {"min": 64, "step": 64, "max": 128}}},
        "below spec.batching.maxNumBatchedTokens",
        at_create="spec.batching.prefillBuckets: Invalid value: the runtime would refuse it",
    ),
    Row(
        "bucket-min-above-max",
        {"batching": {**CB, "kvBuckets": {"min": 512, "step": 64, "max": 256}}},
        "min 512 is above max 256",
        at_create="spec.batching.kvBuckets: Invalid value: min is above max",
    ),
    Row(
        "generate-shape-without-new-tokens",
        {"batching": {"mode": "static", "shapes": [{"promptLength": 64, "batchSize": 1}]}},
        "spec.batching.shapes[0].newTokens",
        at_create="spec.batching.shapes: Invalid value: every shape of a generate model needs newTokens",
    ),
    Row(
        "pooling-continuous",
        {"task": "embed", "batching": CB},
        "embed models run on static warm-up shapes",
        at_create="spec.batching: Invalid value: embed models run on static warm-up shapes",
    ),
    Row(
        "pooling-two-cards",
        {"task": "rerank", "cards": 2, "batching": {"mode": "static", "shapes": POOLING_SHAPES}},
        "pooling models run on one card",
        at_create="spec.cards: Invalid value: rerank models (pooling) run on one card",
    ),
    Row(
        "too-large-for-one-card",
        {"backend": "sendnn", "model": {"source": "pvc://models/big", "config": LLAMA_70B}},
        "the memory plan does not fit",
    ),
    # plain schema types and enums
    Row(
        "cards-three",
        {"cards": 3},
        "must be one of 1, 2, 4, 8",
        at_create="spec.cards: Unsupported value: 3",
        schema=True,
    ),
    Row(
        "replicas-string",
        {"replicas": "2"},
        "must be an integer",
        at_create="spec.replicas in body must be of type integer",
        schema=True,
    ),
    Row(
        "dtype-int8",
        {"dtype": "int8"},
        "spec.dtype",
        at_create='spec.dtype: Unsupported value: "int8"',
        schema=True,
    ),
    Row(
        "kv-cache-dtype-int8",
        {"kvCacheDtype": "int8"},
        "spec.kvCacheDtype: must be one of auto, float32, bfloat16, float16, got 'int8'",
        at_create='spec.kvCacheDtype: Unsupported value: "int8"',
        schema=True,
    ),
    # Spyre cards keep the KV cache in the model's dtype (float16 with dtype auto); CPU backends may narrow it
    Row(
        "kv-cache-bfloat16-on-sendnn",
        {"backend": "sendnn", "kvCacheDtype": "bfloat16"},
        "must be auto or float16 with backend sendnn, got 'bfloat16': Spyre cards keep the KV cache in the "
        "model's float16",
        at_create="spec.kvCacheDtype: Invalid value: must be auto or float16 with backend sendnn, got "
        "bfloat16: Spyre cards keep the KV cache in the model's float16",
    ),
    Row(
        "kv-cache-not-the-models-dtype-on-sendnn",
        {"backend": "sendnn", "dtype": "bfloat16", "kvCacheDtype": "float16"},
        "must be auto or bfloat16 with backend sendnn, got 'float16'",
        at_create="spec.kvCacheDtype: Invalid value: must be auto or bfloat16 with backend sendnn, got "
        "float16",
    ),
    # the same rule on what the pod would get: an env override the spec's fields do not show
    Row(
        "env-kv-cache-bfloat16-on-sendnn",
        {"backend": "sendnn", "env": [{"name": "SENDNN_INFERENCE_KV_CACHE_DTYPE", "value": "bfloat16"}]},
        "the runtime would refuse it: a bfloat16 KV cache (--kv-cache-dtype, "
        "SENDNN_INFERENCE_KV_CACHE_DTYPE, spec.kvCacheDtype): Spyre cards (backend sendnn) keep the KV "
        "cache in the model's float16",
    ),
    # on CPU only a float32 model narrows its cache (the kernels read bf16/fp16 under a float32 query)
    Row(
        "kv-cache-float16-under-a-bfloat16-model",
        {"dtype": "bfloat16", "kvCacheDtype": "float16"},
        "spec.kvCacheDtype: the runtime would refuse it: a float16 KV cache (--kv-cache-dtype, "
        "SENDNN_INFERENCE_KV_CACHE_DTYPE, spec.kvCacheDtype) under a bfloat16 model: only a float32 model "
        "takes",
    ),
    # a pooling model keeps no KV cache: any kvCacheDtype but auto would do nothing
    Row(
        "kv-cache-dtype-on-a-pooling-model",
        {
            "task": "embed",
            "batching": {"shapes": POOLING_SHAPES},
            "dtype": "float32",
            "kvCacheDtype": "bfloat16",
        },
        "spec.kvCacheDtype: 'bfloat16' has no effect on a pooling model, which keeps no KV cache; leave it "
        "auto",
        at_create="spec.kvCacheDtype: Invalid value: has no effect on a pooling model, which keeps no KV "
        "cache; leave it auto",
    ),
    Row(
        "env-kv-cache-dtype-on-a-pooling-model",
        {
            "task": "score",
            "batching": {"shapes": POOLING_SHAPES},
            "env": [{"name": "SENDNN_INFERENCE_KV_CACHE_DTYPE", "value": "float32"}],
        },
        "spec.env: the runtime would refuse it: SENDNN_INFERENCE_KV_CACHE_DTYPE='float32' has no effect on a "
        "pooling model",
    ),
    Row(
        "suspend-string",
        {"suspend": "yes"},
        "true or false",
        at_create="spec.suspend in body must be of type boolean",
        schema=True,
    ),
    Row(
        "rollout-negative",
        {"rollout": {"maxSurge": -1}},
        "spec.rollout.maxSurge",
        at_create="spec.rollout.maxSurge: Invalid value: must be a count >= 0 or a percentage",
    ),
    Row(
        "rollout-percent",
        {"rollout": {"maxUnavailable": "150%"}},
        "spec.rollout.maxUnavailable",
        at_create="spec.rollout.maxUnavailable: Invalid value: must be a count >= 0 or a percentage",
    ),
    # model sources (issue 25): each scheme's grammar, and the fields only the downloaded ones take
    Row(
        "source-http",
        {"model": {"source": "http://hub/model"}},
        "spec.model.source: must be one of pvc://CLAIM/PATH, file:///PATH, oci://",
        at_create="spec.model.source in body should match",
        schema=True,
    ),
    Row(
        "source-s3-without-prefix",
        {"model": {"source": "s3://bucket/"}},
        "spec.model.source: 's3://bucket/' is not s3://BUCKET/PREFIX",
        at_create="spec.model.source in body should match",
        schema=True,
    ),
    Row(
        "source-s3-bucket-name",
        {"model": {"source": "s3://My_Bucket/model"}},
        "is not s3://BUCKET/PREFIX (a bucket name of 3-63 lower-case letters",
        at_create="spec.model.source in body should match",
        schema=True,
    ),
    Row(
        "source-hf-without-name",
        {"model": {"source": "hf://granite-3b"}},
        "spec.model.source: 'hf://granite-3b' is not hf://ORG/NAME[@REVISION]",
        at_create="spec.model.source in body should match",
        schema=True,
    ),
    Row(
        "source-hf-double-dash",
        {"model": {"source": "hf://ibm--granite/model"}},
        "spec.model.source: 'hf://ibm--granite/model': a Hub repository id has no '--' or '..'",
        at_create="'hf://ibm--granite/model': a Hub repository id has no '--' or '..'",
    ),
    Row(
        "source-oci-upper-case",
        {"model": {"source": "oci://quay.io/Org/model:1"}},
        "repository name must be lowercase",
        at_create="couldn't parse image reference 'quay.io/Org/model:1'",
    ),
    Row(
        "source-oci-without-registry",
        {"model": {"source": "oci://granite-model:1"}},
        "spec.model.source: 'oci://granite-model:1' names no registry",
        at_create="'oci://granite-model:1' names no registry",
    ),
    Row(
        "secret-ref-on-a-claim",
        {"model": {"source": "pvc://models/tiny", "secretRef": "hub-token"}},
        "spec.model.secretRef: applies to hf:// and s3:// sources only, not pvc://",
        at_create="spec.model.secretRef: Invalid value",
    ),
    Row(
        "endpoint-on-an-image",
        {"model": {"source": "oci://quay.io/org/model:1", "endpoint": "https://hub.example.com"}},
        "spec.model.endpoint: applies to hf:// and s3:// sources only, not oci://",
        at_create="spec.model.endpoint: Invalid value",
    ),
    Row(
        "endpoint-not-a-url",
        {"model": {"source": "s3://models/granite", "endpoint": "minio:9000"}},
        "spec.model.endpoint: must be an http:// or https:// URL, got 'minio:9000'",
        at_create="spec.model.endpoint in body should match",
        schema=True,
    ),
    Row(
        "secret-ref-not-a-name",
        {"model": {"source": "hf://ibm/granite", "secretRef": "Hub Token"}},
        "spec.model.secretRef: must be a Secret's name",
        at_create="spec.model.secretRef in body should match",
        schema=True,
    ),
    Row(
        "download-without-graph-cache",
        {"model": {"source": "hf://ibm/granite"}, "graphCache": {"enabled": False}},
        "spec.graphCache.enabled: hf:// models are downloaded into the graph-cache claim",
        at_create="spec.graphCache.enabled: Invalid value",
    ),
    Row(
        "source-file-not-allowed",
        {"model": {"source": "file:///var/models/granite"}},
        "file:// models (a hostPath on the node) are turned off; an admin turns them on",
    ),
    # the InferencePool (Gateway API Inference Extension v1): the runtime's port, a picker that can be reached
    Row(
        "pool-port-unknown",
        {"inferencePool": {"targetPort": 9000}},
        "spec.inferencePool.targetPort: 9000 is not a port of the model's pods: the runtime serves on 8000",
    ),
    Row(
        "pool-port-out-of-range",
        {"inferencePool": {"targetPort": 70000}},
        "spec.inferencePool.targetPort: must be the runtime's port: its number (1-65535) or its name http",
        at_create="spec.inferencePool.targetPort: Invalid value: 70000: must be the runtime's port",
    ),
    Row(
        "pool-port-name-unknown",
        {"inferencePool": {"targetPort": "grpc"}},
        "spec.inferencePool.targetPort: must be the runtime's port",
        at_create='spec.inferencePool.targetPort: Invalid value: "grpc": must be the runtime\'s port',
    ),
    Row(
        "pool-app-protocol",
        {"inferencePool": {"appProtocol": "grpc"}},
        "spec.inferencePool.appProtocol: must be http or kubernetes.io/h2c",
        at_create='spec.inferencePool.appProtocol: Unsupported value: "grpc"',
        schema=True,
    ),
    Row(
        "pool-enabled-string",
        {"inferencePool": {"enabled": "yes"}},
        "spec.inferencePool.enabled: must be true or false",
        at_create="spec.inferencePool.enabled in body must be of type boolean",
        schema=True,
    ),
    Row(
        "picker-without-name",
        {"inferencePool": {"endpointPickerRef": {"port": {"number": 9002}}}},
        "spec.inferencePool.endpointPickerRef.name: is required",
        at_create="spec.inferencePool.endpointPickerRef.name: Required value",
        schema=True,
    ),
    Row(
        "picker-port-out-of-range",
        {"inferencePool": {"endpointPickerRef": {"name": "epp", "port": {"number": 70000}}}},
        "spec.inferencePool.endpointPickerRef.port.number: must be at most 65535, got 70000",
        at_create="endpointPickerRef.port.number in body should be less than or equal to 65535",
        schema=True,
    ),
    Row(
        "picker-failure-mode",
        {"inferencePool": {"endpointPickerRef": {"name": "epp", "failureMode": "FailSometimes"}}},
        "spec.inferencePool.endpointPickerRef.failureMode: must be FailOpen or FailClose",
        at_create='spec.inferencePool.endpointPickerRef.failureMode: Unsupported value: "FailSometimes"',
        schema=True,
    ),
    Row(
        "picker-not-a-service-name",
        {"inferencePool": {"endpointPickerRef": {"name": "My EPP"}}},
        "spec.inferencePool.endpointPickerRef.name: 'My EPP' is not a Service name",
        at_create="spec.inferencePool.endpointPickerRef.name: Invalid value: 'My EPP' is not a Service name",
    ),
    # who may call the model (spec.auth, spec.tls)
    Row(
        "auth-key-and-kubernetes",
        {"auth": {"apiKey": {"secretRef": {"name": "model-key", "key": "api-key"}}, "kubernetes": {}}},
        "spec.auth: apiKey and kubernetes exclude each other",
        at_create="apiKey and kubernetes exclude each other",
    ),
    Row(
        "auth-key-without-key",
        {"auth": {"apiKey": {"secretRef": {"name": "model-key"}}}},
        "spec.auth.apiKey.secretRef.key: must be a Secret key",
        at_create="spec.auth.apiKey.secretRef.key: Required value",
        schema=True,
    ),
    Row(
        "auth-key-secret-not-a-name",
        {"auth": {"apiKey": {"secretRef": {"name": "Model Key", "key": "api-key"}}}},
        "spec.auth.apiKey.secretRef.name: must be a Secret's name",
        at_create="spec.auth.apiKey.secretRef.name in body should match",
        schema=True,
    ),
    Row(
        "auth-key-also-in-env",
        {"auth": KEY_AUTH, "env": [{"name": "VLLM_API_KEY", "value": "in-clear"}]},
        "spec.env: VLLM_API_KEY is set by spec.auth",
    ),
    Row(
        "tls-secret-not-a-name",
        {"tls": {"secretName": "My TLS"}},
        "spec.tls.secretName: must be a Secret's name",
        at_create="spec.tls.secretName in body should match",
        schema=True,
    ),
    Row(
        "tls-paths-also-in-env",
        {"tls": {"secretName": "model-tls"}, "env": [{"name": "SPYRE_SSL_KEYFILE", "value": "/tmp/k"}]},
        "spec.env: SPYRE_SSL_KEYFILE is set by spec.tls",
    ),
    # the image: a reference the kubelet parses (else InvalidImageName, and the pod never starts)
    Row(
        "kv-events-static",
        {"kvEvents": {}},
        "spec.kvEvents: needs continuous batching: KV events come from its prefix cache",
        at_create="spec.kvEvents needs continuous batching: KV events come from its prefix cache",
    ),
    Row(
        "network-peer-ip-block-and-pods",
        {"networkPolicy": {"from": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}},
        "spec.networkPolicy.from[0]: ipBlock excludes podSelector and namespaceSelector",
        at_create="ipBlock excludes podSelector and namespaceSelector",
    ),
    Row(
        "image-empty",
        {"image": ""},
        "spec.image",
        at_create="spec.image: Invalid value: \"\": couldn't parse image reference '': invalid reference",
        legacy="spec.image in body must be of type string",  # the 1.20 server reads "" as null
    ),
    Row(
        "image-not-a-reference",
        {"image": "Quay.io/Spyre Runtime:1"},
        "spec.image: couldn't parse image reference",
        at_create="couldn't parse image reference 'Quay.io/Spyre Runtime:1': invalid reference format",
    ),
    Row(
        "image-upper-case-path",
        {"image": "quay.io/Spyre/runtime:1"},
        "repository name must be lowercase",
        at_create='spec.image: Invalid value: "quay.io/Spyre/runtime:1": couldn\'t parse image reference',
    ),
]
