"""The CRD against a current API server: the CRD API server (k8s.io/apiextensions-apiserver, 1.34 or
newer: tests/cluster/build-crd-server.sh checks and records the version it built) beside the 1.20 control
plane, which it delegates authentication and authorization to. 1.20 ignores CEL (`x-kubernetes-validations`);
the current server compiles every rule, checks its cost budget when the CRD is written, and enforces it on
every create and update. A rule that fails either way would break `kubectl apply -f crds/` on every modern
cluster while the 1.20 tests stay green."""

from __future__ import annotations

import copy

import pytest
import yaml

from tests.cluster.crdserver import CRDServer, crd_server_version
from tests.conftest import REPO
from tests.operator.catalog import BASE, CATALOG

pytestmark = pytest.mark.cluster

SHIPPED_CRDS = sorted([*REPO.glob("crds/*.yaml"), *REPO.glob("charts/*/crds/*.yaml")])
# the CRDs the test control plane installs besides ours (the InferencePool, written from its published v1 API)
TEST_CRDS = sorted(REPO.glob("tests/cluster/crds/*.yaml"))
MODELS = "/apis/spyre-serve.io/v1alpha1/namespaces/default/spyremodels"
POOLS = "/apis/inference.networking.k8s.io/v1/namespaces/default/inferencepools"


@pytest.fixture(scope="module")
def crd_server(cluster, tmp_path_factory):
    server = CRDServer(cluster, tmp_path_factory.mktemp("crd-server"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def spyremodel_crd(crd_server):
    crd = yaml.safe_load((REPO / "crds/spyremodels.yaml").read_text())
    crd_server.apply_crd(crd)
    return crd


def model(name: str = "m", **changes) -> dict:
    spec = {**copy.deepcopy(BASE), **copy.deepcopy(changes)}
    return {
        "apiVersion": "spyre-serve.io/v1alpha1",
        "kind": "SpyreModel",
        "metadata": {"name": name},
        "spec": spec,
    }


def create(server: CRDServer, body: dict, dry_run: bool = True):
    return server.request("POST", MODELS + ("?dryRun=All" if dry_run else ""), body)


def test_the_server_is_the_recorded_version_and_current_enough(crd_server):
    """The build checked what Debian sid shipped and recorded it; the running binary answers that version."""
    recorded = crd_server_version()
    assert tuple(int(p) for p in recorded.split(".")[:2]) >= (1, 34), recorded
    answer = crd_server.request("GET", "/version")
    assert answer.code == 200, answer
    assert answer.body["gitVersion"] == f"v{recorded}" and answer.body["minor"] == recorded.split(".")[1]
    assert crd_server.version == recorded


@pytest.mark.parametrize("path", SHIPPED_CRDS + TEST_CRDS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_crd_we_ship_is_accepted_and_established(crd_server, path):
    for crd in yaml.safe_load_all(path.read_text()):
        conditions = crd_server.apply_crd(crd)
        assert conditions["NamesAccepted"]["status"] == "True", conditions
        assert "NonStructuralSchema" not in conditions, conditions["NonStructuralSchema"]["message"]


def test_a_rule_that_does_not_compile_is_refused(crd_server):
    """The check above could fail: the same CRD under another group, with one rule naming a field that does
    not exist, is refused when it is written, with CEL's compile error."""
    broken = yaml.safe_load((REPO / "crds/spyremodels.yaml").read_text())
    broken["metadata"]["name"] = "spyremodels.broken.spyre-serve.io"
    broken["spec"]["group"] = "broken.spyre-serve.io"
    spec_schema = broken["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec_schema["x-kubernetes-validations"].append({"rule": "self.noSuchField > 0", "message": "never"})
    answer = crd_server.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", broken)
    assert answer.code == 422, answer
    assert "compilation failed" in answer.message and "noSuchField" in answer.message


def test_a_valid_model_is_created_with_the_schema_defaults(crd_server, spyremodel_crd):
    answer = create(crd_server, model("valid", model={"source": "pvc://models/tiny"}), dry_run=False)
    assert answer.code == 201, answer
    spec = answer.body["spec"]
    assert (spec["cards"], spec["replicas"], spec["task"], spec["dtype"]) == (1, 1, "generate", "auto")
    assert spec["kvCacheDtype"] == "auto"
    assert crd_server.request("DELETE", f"{MODELS}/valid").code == 200


CB = {"mode": "continuous", "maxNumSeqs": 4, "maxModelLen": 256}

# What the current server refuses when the SpyreModel is created, with (part of) its message.
REFUSED_AT_CREATE = [
    ("static-without-shapes", {"batching": {"mode": "static"}}, "static batching needs at least one shape"),
    (
        "continuous-without-limits",
        {"batching": {"mode": "continuous", "maxNumSeqs": 4}},
        "continuous batching needs spec.batching.maxNumSeqs and spec.batching.maxModelLen",
    ),
    (
        "claim-and-class",
        {"graphCache": {"existingClaim": "x", "storageClassName": "y"}},
        "existingClaim and spec.graphCache.storageClassName exclude each other",
    ),
    (
        "precompile-without-cache",
        {"graphCache": {"enabled": False, "precompile": True}},
        "spec.graphCache.precompile needs spec.graphCache.enabled",
    ),
    ("cards-three", {"cards": 3}, 'spec.cards: Unsupported value: 3: supported values: "1", "2", "4", "8"'),
    ("source-http", {"model": {"source": "http://hub/model"}}, "spec.model.source in body should match"),
    (
        "prompt-not-multiple",
        {"batching": {"shapes": [{"promptLength": 100, "batchSize": 1}]}},
        "multiple of 64",
    ),
]


@pytest.mark.parametrize(
    ("case", "changes", "message"), REFUSED_AT_CREATE, ids=[c[0] for c in REFUSED_AT_CREATE]
)
def test_the_current_server_refuses_at_create_time(crd_server, spyremodel_crd, case, changes, message):
    answer = create(crd_server, model(**changes))
    assert answer.code == 422, answer
    assert message in answer.message


POOLING_SHAPES = [{"promptLength": 64, "batchSize": 4}]
NEEDS_LIMITS = (
    "spec.batching: Invalid value: continuous batching needs spec.batching.maxNumSeqs and "
    "spec.batching.maxModelLen (continuous is the default for generate models; batching.mode: static keeps "
    "sendnn-inference 1.x's warm-up shapes)"
)
# spec.batching.mode has no schema default: a model without it runs its task's mode, continuous for generate
# and static for embed, score and rerank; the CEL rules and the operator resolve it alike
WITHOUT_A_MODE = [
    ("generate-limits", "generate", {"maxNumSeqs": 4, "maxModelLen": 256}, "continuous", ""),
    (
        "generate-shapes",
        "generate",
        {"shapes": [{"promptLength": 64, "newTokens": 8, "batchSize": 1}]},
        "",
        NEEDS_LIMITS,
    ),
    ("generate-no-batching", "generate", None, "", NEEDS_LIMITS),
    (
        "generate-chunk-above-max-model-len",
        "generate",
        {"maxNumSeqs": 4, "maxModelLen": 256, "maxNumBatchedTokens": 1088},
        "",
        "spec.batching.maxNumBatchedTokens: Invalid value: the runtime would refuse it: the chunk",
    ),
    ("embed-shapes", "embed", {"shapes": POOLING_SHAPES}, "static", ""),
    # continuous batching's ranges do not apply to a static model: the CRD checks them no more than the
    # operator does
    (
        "rerank-shapes-and-an-unused-range",
        "rerank",
        {"shapes": POOLING_SHAPES, "kvBuckets": {"min": 512, "step": 64, "max": 256}},
        "static",
        "",
    ),
    (
        "score-no-batching",
        "score",
        None,
        "",
        "static batching needs at least one shape in spec.batching.shapes",
    ),
]


@pytest.mark.parametrize(
    ("case", "task", "batching", "mode", "message"), WITHOUT_A_MODE, ids=[c[0] for c in WITHOUT_A_MODE]
)
def test_without_a_batching_mode_the_task_s_mode_applies(
    crd_server, spyremodel_crd, case, task, batching, mode, message
):
    from spyre_operator.admission import check_spec
    from spyre_operator.settings import OperatorSettings
    from spyre_operator.spec.model_spec import InvalidSpec
    from spyre_operator.spec.parse import parse_spec

    spec = {key: value for key, value in BASE.items() if key != "batching"}
    spec = {**spec, "task": task, **({"batching": batching} if batching is not None else {})}
    answer = create(crd_server, {**model(case), "spec": copy.deepcopy(spec)}, dry_run=False)
    if message:
        assert answer.code == 422, answer
        assert message in answer.message
        with pytest.raises(InvalidSpec):  # the operator refuses it too (clusters that ignore CEL)
            check_spec(case, spec, OperatorSettings())
        return
    assert answer.code == 201, answer
    assert "mode" not in answer.body["spec"]["batching"]  # the server stores no mode ...
    assert parse_spec(case, answer.body["spec"]).mode == mode  # ... and the operator runs the task's
    check_spec(case, spec, OperatorSettings())
    assert crd_server.request("DELETE", f"{MODELS}/{case}").code == 200


@pytest.mark.parametrize("row", CATALOG, ids=lambda row: row.id)
def test_the_hostile_catalog_against_the_current_server(crd_server, spyremodel_crd, row):
    """The catalog's own column says what a current cluster answers at create time (the schema or a CEL
    rule); the operator refuses every row again (clusters older than 1.25 ignore CEL), as its tests show."""
    answer = create(crd_server, model(row.name, **row.changes))
    if row.at_create:
        assert answer.code == 422, answer
        assert row.at_create in answer.message
    else:  # left to the operator (InvalidSpec) or to the API server's dry run of the pod
        assert answer.code == 201, answer


ACCEPTED = {
    **{
        f"example-{path.stem}": (doc["metadata"]["name"], doc["spec"])
        for path in sorted((REPO / "examples").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc["kind"] == "SpyreModel"
    },
    "continuous-with-bucket-ranges": (
        "cb",
        {
            **BASE,
            "batching": {
                "mode": "continuous",
                "maxNumSeqs": 8,
                "maxModelLen": 512,
                "maxNumBatchedTokens": 256,
                "decodeBatchBuckets": {"min": 1, "step": 4, "max": 8},
                "kvBuckets": {"min": 128, "step": 128, "max": 512},
                "prefillBuckets": {"min": 64, "step": 64, "max": 256},
            },
        },
    ),
    "kv-cache-narrower-than-the-model": ("kv", {**BASE, "dtype": "float32", "kvCacheDtype": "bfloat16"}),
    "kv-cache-float16-on-spyre": ("kv-spyre", {**BASE, "backend": "sendnn", "kvCacheDtype": "float16"}),
    "kv-cache-of-the-models-dtype-on-spyre": (
        "kv-spyre-bf16",
        {**BASE, "backend": "sendnn", "dtype": "bfloat16", "kvCacheDtype": "bfloat16"},
    ),
    "cards-by-dra": ("dra", {**BASE, "cards": 4, "devices": {}}),
    "virtual-functions-by-dra": ("dra-vf", {**BASE, "devices": {}, "cardResource": "ibm.com/spyre_vf"}),
    "card-resource-with-matching-count": (
        "tier",
        {
            **BASE,
            "cards": 2,
            "cardResource": "ibm.com/spyre_pf_tier0",
            "resources": {
                "requests": {"cpu": "2", "ibm.com/spyre_pf_tier0": 2},
                "limits": {"memory": "16Gi"},
            },
        },
    ),
    "env-the-runtime-accepts": (
        "env",
        {
            **BASE,
            "env": [
                {"name": "SENDNN_INFERENCE_WARMUP_BATCH_SIZES", "value": "4"},
                {"name": "SENDNN_INFERENCE_USE_CB", "value": "0"},
                {"name": "SENDNN_INFERENCE_DYNAMO_BACKEND", "value": " Inductor "},
                {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
            ],
        },
    ),
    "inference-pool": (
        "pooled",
        {
            **BASE,
            "inferencePool": {
                "targetPort": "http",
                "appProtocol": "kubernetes.io/h2c",
                "endpointPickerRef": {
                    "group": "",
                    "kind": "Service",
                    "name": "router",
                    "port": {"number": 9002},
                    "failureMode": "FailOpen",
                },
            },
        },
    ),
    "inference-pool-picker-of-another-kind": (
        "picked",
        {
            **BASE,
            "inferencePool": {
                "targetPort": 8000,
                "endpointPickerRef": {"group": "x.io", "kind": "Picker", "name": "Any.Name"},
            },
        },
    ),
    "placement": (
        "placed",
        {
            **BASE,
            "nodeSelector": {"ibm.com/spyre.product": "spyre-v1", "zone": ""},
            "tolerations": [{"key": "ibm.com/spyre", "operator": "Exists", "effect": "NoSchedule"}],
            "schedulerName": "spyre-scheduler",
            "rollout": {"maxSurge": "25%", "maxUnavailable": 0},
            "image": "quay.io/spyre-serve/runtime@sha256:" + "a" * 64,
        },
    ),
}


@pytest.mark.parametrize(("name", "spec"), ACCEPTED.values(), ids=ACCEPTED.keys())
def test_what_the_operator_accepts_the_current_server_accepts(crd_server, spyremodel_crd, name, spec):
    """The CEL rules refuse no less than the operator does, and no more: every example and a spec of each
    kind the operator accepts is created, and the schema's default fills spec.devices.matchAttribute; the
    DeviceClass is the operator's default (the kind of card spec.cardResource names, else spyre-pf)."""
    from spyre_operator.admission import check_spec
    from spyre_operator.settings import OperatorSettings

    checked = check_spec(name, spec, OperatorSettings())
    answer = create(crd_server, {**model(name), "spec": copy.deepcopy(spec)})
    assert answer.code == 201, answer
    if "devices" in spec:
        defaulted = {"matchAttribute": "spyre.ibm.com/numaInfo", **spec["devices"]}
        assert answer.body["spec"]["devices"] == defaulted
        vf = spec.get("cardResource") == "ibm.com/spyre_vf"
        default = "spyre-standard-vf" if vf else "spyre-pf"
        assert checked.devices.device_class == spec["devices"].get("deviceClassName", default)


@pytest.fixture(scope="module")
def inferencepool_crd(crd_server):
    (crd,) = [yaml.safe_load(path.read_text()) for path in TEST_CRDS if path.stem == "inferencepool"]
    crd_server.apply_crd(crd)
    return crd


@pytest.mark.parametrize("name", ["pooled", "picked"])
def test_the_inference_pool_the_operator_writes_is_stored_as_written(crd_server, inferencepool_crd, name):
    """Against the published v1 API with its CEL rules (our CRD text of it): the pool the operator builds is
    accepted, and the server's defaults add nothing but the picker's core group, which the operator leaves to
    them (so drift is never a default)."""
    from spyre_operator.admission import check_spec
    from spyre_operator.kinds import inference_pool as gateway
    from spyre_operator.kinds.inference_pool import build_inference_pool
    from spyre_operator.settings import OperatorSettings

    _, spec = ACCEPTED["inference-pool" if name == "pooled" else "inference-pool-picker-of-another-kind"]
    meta = {"name": name, "namespace": "default", "uid": "u-1"}
    pool = build_inference_pool(
        {"metadata": meta}, check_spec(name, spec, OperatorSettings()), OperatorSettings()
    )
    pool["metadata"].pop("ownerReferences")  # no such SpyreModel on this server
    answer = crd_server.request("POST", POOLS, pool)
    assert answer.code == 201, answer
    stored = answer.body["spec"]
    assert stored == {**pool["spec"], "endpointPickerRef": {"group": "", **pool["spec"]["endpointPickerRef"]}}
    assert gateway.pool_repair(answer.body, pool) is None
    assert crd_server.request("DELETE", f"{POOLS}/{name}").code == 200


@pytest.mark.parametrize(
    ("case", "change", "message"),
    [
        (
            "service-picker-without-port",
            {"endpointPickerRef": {"name": "epp"}},
            "a Service endpoint picker needs its port",
        ),
        (
            "same-port-twice",
            {"targetPorts": [{"number": 8000}, {"number": 8000}]},
            "every port number may appear once",
        ),
        (
            "nine-ports",
            {"targetPorts": [{"number": 8000 + i} for i in range(9)]},
            "must have at most 8 items",
        ),
        ("no-picker", {"endpointPickerRef": None}, "spec.endpointPickerRef: Required value"),
        ("h3", {"appProtocol": "h3"}, 'spec.appProtocol: Unsupported value: "h3"'),
    ],
)
def test_the_inference_pool_crd_refuses_what_the_v1_api_refuses(
    crd_server, inferencepool_crd, case, change, message
):
    spec = {
        "selector": {"matchLabels": {"app": "x"}},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
    }
    spec.update(change)
    spec = {k: v for k, v in spec.items() if v is not None}
    body = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": case},
        "spec": spec,
    }
    answer = crd_server.request("POST", POOLS + "?dryRun=All", body)
    assert answer.code == 422, answer
    assert message in answer.message
