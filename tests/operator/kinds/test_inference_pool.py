"""Behind a gateway, without a cluster: the InferencePool the operator writes per model (Gateway API Inference
Extension v1), the rules of spec.inferencePool, the step that keeps the pool (made, repaired, removed; skipped
while the cluster does not serve the API) and its condition. The examples: test_examples.py."""

from __future__ import annotations

import copy

import pytest
from kubernetes.client.rest import ApiException
from spyre_operator.admission import check_spec
from spyre_operator.io.work import Pass
from spyre_operator.kinds import inference_pool as gateway
from spyre_operator.kinds.compile_job import build_compile_job, cache_key
from spyre_operator.kinds.inference_pool import UNAVAILABLE, InferencePoolStep, PoolState
from spyre_operator.kinds.pods.template import build_pod
from spyre_operator.settings import OperatorSettings, load_settings
from spyre_operator.spec.model_spec import InvalidSpec
from spyre_operator.status.conditions import compute_status

from tests.operator.catalog import BASE, model_object

SETTINGS = OperatorSettings()


model = model_object


def pool_of(m: dict, settings: OperatorSettings = SETTINGS) -> dict | None:
    return gateway.build_inference_pool(m, check_spec(m["metadata"]["name"], m["spec"], settings), settings)


def selects(pool: dict, labels: dict) -> bool:
    return pool["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_pool_selects_exactly_the_serving_pods_on_the_runtime_port():
    m = model(graphCache={"precompile": True}, inferencePool={})
    spec = check_spec("granite", m["spec"], SETTINGS)
    pool = gateway.build_inference_pool(m, spec, SETTINGS)
    pod = build_pod(m, spec, SETTINGS)
    job = build_compile_job(m, spec, SETTINGS, cache_key(spec, SETTINGS))
    assert selects(pool, pod["metadata"]["labels"])
    assert not selects(pool, job["spec"]["template"]["metadata"]["labels"])  # the compile Job's pods
    assert not selects(pool, pool_of(model("other", inferencePool={}))["spec"]["selector"]["matchLabels"])
    assert pod["metadata"]["labels"]["llm-d.ai/engine-type"] == "vllm"
    container_ports = [p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]]
    assert pool["spec"]["targetPorts"] == [{"number": n} for n in container_ports] == [{"number": 8000}]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    assert (pool["metadata"]["name"], pool["metadata"]["namespace"]) == ("granite", "ml")
    owner = pool["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("SpyreModel", "u-1", True)
    assert pool["spec"]["appProtocol"] == "http"
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service",
        "name": "granite-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    # a picker of another kind needs no port; a long model name still makes a Service name
    other = pool_of(
        model(inferencePool={"endpointPickerRef": {"group": "x.io", "kind": "Picker", "name": "p"}})
    )
    assert "port" not in other["spec"]["endpointPickerRef"]
    assert len(gateway.picker_name("m" * 63)) <= 63


@pytest.mark.parametrize(
    ("section", "setting", "wanted"),
    [
        (None, False, False),
        (None, True, True),
        ({}, False, True),  # the section present: enabled
        ({"enabled": False}, True, False),
        ({"enabled": True}, False, True),
    ],
)
def test_a_pool_is_wanted_by_the_spec_or_else_by_the_operator_setting(section, setting, wanted):
    settings = load_settings({"SPYRE_OPERATOR_INFERENCE_POOL": "1" if setting else "0"})
    m = model() if section is None else model(inferencePool=section)
    assert (pool_of(m, settings) is not None) == wanted


@pytest.mark.parametrize(
    ("section", "field", "rule"),
    [
        ({"targetPort": 9000}, "inferencePool.targetPort", "9000 is not a port of the model's pods"),
        ({"targetPort": "metrics"}, "inferencePool.targetPort", "must be the runtime's port"),
        ({"targetPort": 0}, "inferencePool.targetPort", "must be the runtime's port"),
        ({"targetPort": True}, "inferencePool.targetPort", "must be the runtime's port"),
        ({"appProtocol": "grpc"}, "inferencePool.appProtocol", "must be http or kubernetes.io/h2c"),
        ({"enabled": "yes"}, "inferencePool.enabled", "must be true or false"),
        ({"endpointPickerRef": {}}, "inferencePool.endpointPickerRef.name", "is required"),
        ({"endpointPickerRef": "epp"}, "inferencePool.endpointPickerRef", "must be an object"),
        (
            {"endpointPickerRef": {"name": "epp", "port": {"number": 70000}}},
            "inferencePool.endpointPickerRef.port.number",
            "must be at most 65535",
        ),
        (
            {"endpointPickerRef": {"name": "epp", "port": 9002}},
            "inferencePool.endpointPickerRef.port",
            "must be an object with a number",
        ),
        (
            {"endpointPickerRef": {"name": "epp", "failureMode": "Retry"}},
            "inferencePool.endpointPickerRef.failureMode",
            "must be FailOpen or FailClose",
        ),
        (
            {"endpointPickerRef": {"name": "EPP"}},
            "inferencePool.endpointPickerRef.name",
            "not a Service name",
        ),
        (
            {"endpointPickerRef": {"name": "epp", "kind": "my kind"}},
            "inferencePool.endpointPickerRef.kind",
            "must be a resource kind",
        ),
        (
            {"endpointPickerRef": {"name": "epp", "group": "Not_A_Group"}},
            "inferencePool.endpointPickerRef.group",
            "must be an API group",
        ),
    ],
)
def test_a_bad_inference_pool_is_invalid_spec_naming_the_field(section, field, rule):
    with pytest.raises(InvalidSpec) as err:
        check_spec("granite", model(inferencePool=section)["spec"], SETTINGS)
    assert err.value.field_path == field and rule in err.value.rule
    assert str(err.value).startswith(f"spec.{field}: ")


def test_the_port_may_be_named_or_numbered_and_the_pool_spec_leaves_the_pods_alone():
    for port in ("http", 8000):
        assert pool_of(model(inferencePool={"targetPort": port}))["spec"]["targetPorts"] == [{"number": 8000}]
    plain, pooled = model(), model(inferencePool={"appProtocol": "kubernetes.io/h2c"})
    spec_plain, spec_pooled = (check_spec("granite", m["spec"], SETTINGS) for m in (plain, pooled))
    assert build_pod(plain, spec_plain, SETTINGS) == build_pod(pooled, spec_pooled, SETTINGS)  # no rollout


def test_repair_restores_whole_fields_and_ignores_what_the_server_defaults():
    want = pool_of(model(inferencePool={}))
    assert gateway.pool_repair(copy.deepcopy(want), want) is None
    served = copy.deepcopy(want)  # an older CRD: no appProtocol; a picker as its defaults leave it
    del served["spec"]["appProtocol"]
    for key in ("kind", "failureMode"):
        del served["spec"]["endpointPickerRef"][key]
    served["spec"]["endpointPickerRef"]["group"] = ""
    assert gateway.pool_repair(served, want) is None
    drifted = copy.deepcopy(want)
    drifted["spec"]["selector"]["matchLabels"]["app"] = "other"
    drifted["spec"]["targetPorts"].append({"number": 9000})
    drifted["spec"]["endpointPickerRef"]["failureMode"] = "FailOpen"
    assert gateway.pool_repair(drifted, want) == [
        {"op": "add", "path": "/spec/selector", "value": want["spec"]["selector"]},
        {"op": "add", "path": "/spec/targetPorts", "value": want["spec"]["targetPorts"]},
        {"op": "add", "path": "/spec/endpointPickerRef", "value": want["spec"]["endpointPickerRef"]},
    ]


class FakeKube:
    """The calls InferencePoolStep makes, on a dict of pools; without `serves_api` every call answers 404
    (no such resource), as a cluster without the CRD does."""

    def __init__(self, pools=(), serves_api: bool = True, refuse: int | None = None) -> None:
        self.pools = {p["metadata"]["name"]: copy.deepcopy(p) for p in pools}
        self.serves_api, self.refuse = serves_api, refuse
        self.calls: list[str] = []

    def _call(self, verb: str) -> None:
        self.calls.append(verb)
        if not self.serves_api:
            raise ApiException(status=404, reason="Not Found")
        if self.refuse:
            raise ApiException(status=self.refuse, reason="Forbidden")

    def create_unless_exists(self, body):
        self._call("create")
        if body["metadata"]["name"] in self.pools:
            return False
        self.pools[body["metadata"]["name"]] = copy.deepcopy(body)
        return True

    def read(self, kind, name, namespace):
        try:
            self._call("read")
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return copy.deepcopy(self.pools.get(name))

    def patch(self, kind, name, namespace, patch):
        self._call("patch")
        for op in patch:
            self.pools[name]["spec"][op["path"].rsplit("/", 1)[1]] = op["value"]

    def delete(self, kind, name, namespace):
        self._call("delete")
        self.pools.pop(name, None)


class Events:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str]] = []

    def post(self, model, type_, reason, message, once=True):
        if not (once and (reason, message) in self.posted):
            self.posted.append((reason, message))


KEY = ("ml", "granite")


def step_for(kube: FakeKube, settings: OperatorSettings = SETTINGS) -> tuple[InferencePoolStep, Events]:
    events = Events()
    return InferencePoolStep(settings, kube, events), events


def test_the_step_makes_repairs_and_removes_the_pool():
    m = model(inferencePool={})
    spec = check_spec("granite", m["spec"], SETTINGS)
    kube = FakeKube()
    step, events = step_for(kube)
    assert step.ensure(KEY, m, spec, Pass())
    assert kube.pools["granite"] == pool_of(m)
    assert step.state(KEY).is_ready and step.state(KEY).reason == "Reconciled"
    assert [r for r, _ in events.posted] == ["InferencePoolCreated"]
    kube.pools["granite"]["spec"]["targetPorts"] = [{"number": 9999}]  # someone changed it
    assert step.ensure(KEY, m, spec, Pass())
    assert kube.pools["granite"] == pool_of(m) and kube.calls[-1] == "patch"
    assert events.posted[-1] == ("InferencePoolRepaired", "InferencePool granite: targetPorts restored")
    # turned off: the model's own pool goes, and the condition with it
    off = model(inferencePool={"enabled": False})
    assert step.ensure(KEY, off, check_spec("granite", off["spec"], SETTINGS), Pass())
    assert kube.pools == {} and step.state(KEY) is None
    # a pool of the name that the model does not own is a conflict, never touched
    foreign = copy.deepcopy(pool_of(m))
    foreign["metadata"]["ownerReferences"] = []
    kube = FakeKube([foreign])
    step, _ = step_for(kube)
    work = Pass()
    assert not step.ensure(KEY, m, spec, work)
    assert work.problems[0].reason == "InferencePoolConflict" and work.problems[0].is_stalled
    assert step.ensure(KEY, off, check_spec("granite", off["spec"], SETTINGS), Pass())
    assert "delete" not in kube.calls
    # any other refusal is a problem of the pass, named after the kind
    work = Pass()
    assert not step_for(FakeKube(refuse=403))[0].ensure(KEY, m, spec, work)
    assert work.problems[0].reason == "InferencePoolRejected"


def test_without_the_api_the_pool_is_skipped_said_once_and_made_once_the_crd_is_installed(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("spyre_operator.kinds.inference_pool.time.monotonic", lambda: clock[0])
    m = model(inferencePool={})
    spec = check_spec("granite", m["spec"], SETTINGS)
    kube = FakeKube(serves_api=False)
    step, events = step_for(kube)
    work = Pass()
    for _ in range(5):  # pass after pass: not settled, no problem (no retry loop), one question per period
        assert not step.ensure(KEY, m, spec, work)
    assert work.problems == [] and kube.calls == ["create"]
    assert step.state(KEY) == UNAVAILABLE and UNAVAILABLE.reason == "InferencePoolUnavailable"
    assert events.posted == [("InferencePoolUnavailable", UNAVAILABLE.message)]
    # a model that wants no pool is not asked about while the API is not served
    assert step.ensure(("ml", "plain"), model("plain"), check_spec("plain", BASE, SETTINGS), Pass())
    assert kube.calls == ["create"]
    clock[0] += SETTINGS.resync_seconds  # the CRD is installed; the next period asks again
    kube.serves_api = True
    assert step.ensure(KEY, m, spec, Pass())
    assert kube.pools["granite"] == pool_of(m) and step.state(KEY).is_ready
    assert [r for r, _ in events.posted] == ["InferencePoolUnavailable", "InferencePoolCreated"]


def test_the_pool_condition_says_why_and_never_makes_the_model_unready():
    base = {
        "generation": 1,
        "replicas": 0,
        "template_hash": "h",
        "pods": [],
        "health": [],
        "selector": "spyre-serve.io/model=granite",
        "service_address": None,
        "card_resource": "ibm.com/spyre_pf",
    }
    without = compute_status(**base)
    assert "InferencePoolReady" not in {c["type"] for c in without["conditions"]}
    status = compute_status(inference_pool=UNAVAILABLE, **base)
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["InferencePoolReady"]["status"] == "False"
    assert conditions["InferencePoolReady"]["reason"] == "InferencePoolUnavailable"
    assert conditions["Ready"] == {c["type"]: c for c in without["conditions"]}["Ready"]
    ready = compute_status(inference_pool=PoolState(True, "Reconciled", "InferencePool granite ..."), **base)
    assert {c["type"]: c for c in ready["conditions"]}["InferencePoolReady"]["status"] == "True"


def test_a_model_that_wants_no_pool_is_not_asked_about_one_the_watch_never_saw():
    """Issue 37: the watch cache knows which models have a pool; one that wants none, and has none, costs
    no request (at 1,000 models that was a GET of an InferencePool per model)."""
    off = model(inferencePool={"enabled": False})
    spec = check_spec("granite", off["spec"], SETTINGS)
    kube = FakeKube([pool_of(model(inferencePool={}))])
    step, _ = step_for(kube)
    assert step.ensure(KEY, off, spec, Pass(), has_pool=False) and kube.calls == []
    assert step.ensure(KEY, off, spec, Pass(), has_pool=True)  # seen by the watch: removed
    assert kube.calls == ["read", "delete"] and kube.pools == {}


def test_the_watch_cache_says_which_models_have_a_pool():
    from spyre_operator.io.watch import WatchCache

    cache = WatchCache()
    assert not cache.has_pool(KEY)
    assert cache.pool_seen(KEY) and not cache.pool_seen(KEY)  # news once
    assert cache.has_pool(KEY) and not cache.has_pool(("ml", "other"))
    cache.pool_gone(KEY)
    assert not cache.has_pool(KEY) and cache.pool_seen(KEY)
    assert not cache.is_pool_reported(KEY)
    cache.pool_reported(KEY)
    assert cache.is_pool_reported(KEY) and not cache.is_pool_reported(("ml", "other"))
    cache.pool_gone(KEY)
    assert not cache.is_pool_reported(KEY)


def test_a_pool_its_watch_has_not_reported_is_checked_again_at_every_pass():
    """kopf starts the pool watch when the CRD appears; `make test` once saw it not do so after the CRD had
    gone and come back, and a drifted pool stayed drifted (its change never reached the operator). So a pool
    is checked for the model's generation only once its watch has reported it: until then every pass (each
    resync) reads it again and repairs it; after that no pass reads it until the watch says it changed."""
    from kubernetes import client
    from spyre_operator.reconcile import Reconciler

    m = model(inferencePool={})
    spec = check_spec("granite", m["spec"], SETTINGS)
    kube = FakeKube()
    reconciler = Reconciler(SETTINGS, client.ApiClient())
    reconciler.inference_pool, events = step_for(kube)
    assert reconciler._ensure_inference_pool(KEY, m, spec, Pass()).is_ready  # made
    kube.pools["granite"]["spec"]["targetPorts"] = [{"number": 9999}]  # drifted, and no watch event
    assert reconciler._ensure_inference_pool(KEY, m, spec, Pass()).is_ready
    assert kube.pools["granite"] == pool_of(m) and events.posted[-1][0] == "InferencePoolRepaired"
    reconciler.cache.pool_reported(KEY)  # the watch delivers the pool's events
    reconciler._ensure_inference_pool(KEY, m, spec, Pass())  # read once more, then checked
    calls = list(kube.calls)
    for _ in range(3):
        assert reconciler._ensure_inference_pool(KEY, m, spec, Pass()).is_ready
    assert kube.calls == calls
    # a model that wants no pool settles at once, with no watch to wait for
    off = model(inferencePool={"enabled": False})
    off_spec = check_spec("granite", off["spec"], SETTINGS)
    reconciler.cache.owned_changed(KEY)
    assert reconciler._ensure_inference_pool(KEY, off, off_spec, Pass()) is None and kube.pools == {}
    calls = list(kube.calls)
    assert reconciler._ensure_inference_pool(KEY, off, off_spec, Pass()) is None
    assert kube.calls == calls
