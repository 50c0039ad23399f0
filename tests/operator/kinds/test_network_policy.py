"""Who may reach a model's pods (issue 40): the NetworkPolicy the operator writes per model when its setting
is on, checked by its builder (what it selects and admits, by the pods' and namespaces' labels), by the rules
of spec.networkPolicy and spec.kvEvents, by its step against a stand-in API (made, repaired, left alone
when foreign, removed when the setting is off), and on a real control plane of its own: the API server
accepts the policy, the policy's podSelector matches the model's pods and its namespaceSelector the
monitoring namespace, a change of the spec updates it, a deleted one comes back, the model's deletion takes
it with it, and an operator restarted with the setting off removes it. The test plane's bridge CNI enforces
no policy: what is checked is the object and its selectors (docs/security.md names the plugins that
enforce it)."""

from __future__ import annotations

import copy
import json

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from spyre_operator.admission import check_spec
from spyre_operator.io.watch import WatchCache
from spyre_operator.io.work import Pass
from spyre_operator.kinds.compile_job import build_compile_job, cache_key
from spyre_operator.kinds.network_policy import NetworkPolicyStep, build_network_policy
from spyre_operator.kinds.pods.template import build_pod
from spyre_operator.settings import OperatorSettings, SettingsError, load_settings
from spyre_operator.spec.model_spec import InvalidSpec

from tests.cluster.controlplane import ControlPlane, spyre_nodes
from tests.cluster.fakekubelet import FakeKubelet
from tests.conftest import REPO, ensure_k8s_binaries, kubectl, wait_for
from tests.operator.catalog import BASE
from tests.operator.conftest import Namespace, OperatorProcess, service_account_kubeconfig

ON = OperatorSettings(network_policy=True, monitoring_namespace="monitoring")
CB = {"mode": "continuous", "maxNumSeqs": 4, "maxModelLen": 256}
GATEWAY = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}


def model(name: str = "granite", namespace: str = "ml", **spec) -> dict:
    body = {**copy.deepcopy(BASE), **spec}
    return {"metadata": {"name": name, "namespace": namespace, "uid": "u-1", "generation": 1}, "spec": body}


def policy_of(m: dict, settings: OperatorSettings = ON) -> dict | None:
    spec = check_spec(m["metadata"]["name"], m["spec"], settings)
    return build_network_policy(m, spec, settings)


def selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector of matchLabels only (what the operator writes), against an object's labels."""
    return set(selector) <= {"matchLabels"} and selector.get("matchLabels", {}).items() <= labels.items()


def rules_by_port(policy: dict) -> dict[int, list[dict]]:
    """port -> the peers admitted to it, over every rule."""
    found: dict[int, list[dict]] = {}
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            assert port["protocol"] == "TCP"
            found.setdefault(port["port"], []).extend(rule["from"])
    return found


def test_the_policy_selects_the_model_pods_and_admits_its_namespace_its_peers_and_the_scrapers():
    m = model(networkPolicy={"from": [GATEWAY]}, graphCache={"precompile": True})
    spec = check_spec("granite", m["spec"], ON)
    policy = build_network_policy(m, spec, ON)
    pod = build_pod(m, spec, ON)
    assert selects(policy["spec"]["podSelector"], pod["metadata"]["labels"])
    assert not selects(
        policy["spec"]["podSelector"], build_pod(model("other"), spec, ON)["metadata"]["labels"]
    )
    job = build_compile_job(m, spec, ON, cache_key(spec, ON))  # compile Jobs serve nothing: not selected
    assert not selects(policy["spec"]["podSelector"], job["spec"]["template"]["metadata"]["labels"])
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # what the pods reach is left alone
    owner = policy["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "SpyreModel",
        "granite",
        "u-1",
        True,
    )
    assert (policy["metadata"]["name"], policy["metadata"]["namespace"]) == ("granite", "ml")
    # the API port is the runtime's container port; /metrics shares it, so the scrapers reach that port
    (api_port,) = [p["containerPort"] for p in pod["spec"]["containers"][0]["ports"] if p["name"] == "http"]
    by_port = rules_by_port(policy)
    assert set(by_port) == {api_port}  # no KV-events port: the spec does not enable KV events
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    assert by_port[api_port] == [{"podSelector": {}}, GATEWAY, monitoring]  # {}: the model's own namespace
    # the monitoring namespace's rule admits nothing beyond the API's port
    (scrape,) = [r for r in policy["spec"]["ingress"] if monitoring in r["from"]]
    assert scrape["from"] == [monitoring] and scrape["ports"] == [{"protocol": "TCP", "port": api_port}]


def test_the_kv_events_port_is_open_only_where_the_spec_enables_kv_events():
    off = policy_of(model(batching=CB, networkPolicy={"from": [GATEWAY]}))
    on_model = model(batching=CB, networkPolicy={"from": [GATEWAY]}, kvEvents={"port": 5600})
    spec = check_spec("granite", on_model["spec"], ON)
    on = build_network_policy(on_model, spec, ON)
    assert set(rules_by_port(off)) == {8000}
    assert rules_by_port(on)[5600] == [{"podSelector": {}}, GATEWAY]  # the API's peers, not the scrapers
    container = build_pod(on_model, spec, ON)["spec"]["containers"][0]
    assert {"name": "kv-events", "containerPort": 5600, "protocol": "TCP"} in container["ports"]
    flag = container["args"][container["args"].index("--kv-events-config") + 1]
    assert json.loads(flag) == {"enable_kv_cache_events": True, "endpoint": "tcp://*:5600"}
    # the runtime reads the flag as vLLM's: enabled, publishing by ZeroMQ on that port
    from spyre_runtime.engine.kv_events import parse_kv_events_config

    assert parse_kv_events_config(flag).is_enabled and parse_kv_events_config(flag).endpoint == "tcp://*:5600"
    default = check_spec("granite", model(batching=CB, kvEvents={})["spec"], ON)
    assert default.kv_events_port == 5557  # vLLM's default endpoint
    assert (
        "--kv-events-config"
        not in build_pod(model(batching=CB), check_spec("granite", model(batching=CB)["spec"], ON), ON)[
            "spec"
        ]["containers"][0]["args"]
    )


def test_without_the_setting_there_is_no_policy_and_no_monitoring_rule_without_its_namespace():
    assert policy_of(model(networkPolicy={"from": [GATEWAY]}), OperatorSettings()) is None
    bare = policy_of(model(), OperatorSettings(network_policy=True))
    assert bare["spec"]["ingress"] == [
        {"from": [{"podSelector": {}}], "ports": [{"protocol": "TCP", "port": 8000}]}
    ]
    # a model in the monitoring namespace itself needs no second rule
    same = policy_of(model(namespace="monitoring"))
    assert len(same["spec"]["ingress"]) == 1


@pytest.mark.parametrize(
    ("spec", "field", "rule"),
    [
        ({"networkPolicy": {"from": GATEWAY}}, "spec.networkPolicy.from", "must be a list"),
        ({"networkPolicy": {"from": [{}]}}, "spec.networkPolicy.from[0]", "must be an object of"),
        ({"networkPolicy": {"from": [{"pods": {}}]}}, "spec.networkPolicy.from[0]", "must be an object of"),
        (
            {"networkPolicy": {"from": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}},
            "spec.networkPolicy.from[0]",
            "ipBlock excludes podSelector and namespaceSelector",
        ),
        ({"networkPolicy": {"from": [{"ipBlock": {}}]}}, "spec.networkPolicy.from[0].ipBlock", "with a cidr"),
        (
            {"networkPolicy": {"from": [{"podSelector": "app=x"}]}},
            "spec.networkPolicy.from[0].podSelector",
            "",
        ),
        ({"networkPolicy": []}, "spec.networkPolicy", "must be an object"),
        ({"kvEvents": {}}, "spec.kvEvents", "needs continuous batching"),
        ({"kvEvents": {"port": 0}, "batching": CB}, "spec.kvEvents.port", "must be a port number"),
        ({"kvEvents": {"port": "5557"}, "batching": CB}, "spec.kvEvents.port", "must be a port number"),
        ({"kvEvents": {"port": 8000}, "batching": CB}, "spec.kvEvents.port", "the runtime's API port"),
        ({"kvEvents": {"endpoint": "tcp://x:1"}, "batching": CB}, "spec.kvEvents", "optional port"),
    ],
)
def test_a_bad_network_section_is_invalid_spec_naming_the_field(spec, field, rule):
    with pytest.raises(InvalidSpec) as e:
        check_spec("granite", model(**spec)["spec"], ON)
    assert str(e.value).startswith(f"{field}: ") and rule in str(e.value), str(e.value)


def test_the_settings_come_from_the_environment_and_a_bad_namespace_is_named():
    s = load_settings(
        {"SPYRE_OPERATOR_NETWORK_POLICY": "1", "SPYRE_OPERATOR_MONITORING_NAMESPACE": "monitoring"}
    )
    assert s.network_policy and s.monitoring_namespace == "monitoring"
    assert not load_settings({}).network_policy and load_settings({}).monitoring_namespace is None
    with pytest.raises(
        SettingsError, match="SPYRE_OPERATOR_MONITORING_NAMESPACE='Mon_itoring' is not a namespace"
    ):
        load_settings({"SPYRE_OPERATOR_MONITORING_NAMESPACE": "Mon_itoring"})
    with pytest.raises(SettingsError, match="SPYRE_OPERATOR_NETWORK_POLICY='maybe' is not a boolean"):
        load_settings({"SPYRE_OPERATOR_NETWORK_POLICY": "maybe"})


# ---- the step, against a stand-in API --------------------------------------------------------------


class FakeKube:
    def __init__(self, policies: list[dict] | None = None, refuse: int | None = None) -> None:
        self.policies = {p["metadata"]["name"]: copy.deepcopy(p) for p in policies or []}
        self.refuse = refuse
        self.calls: list[str] = []

    def _call(self, verb: str) -> None:
        self.calls.append(verb)
        if self.refuse:
            raise ApiException(status=self.refuse, reason="Forbidden")

    def create_unless_exists(self, body):
        self._call("create")
        if body["metadata"]["name"] in self.policies:
            return False
        # as the API server stores it: an empty matchLabels is dropped
        self.policies[body["metadata"]["name"]] = json.loads(
            json.dumps(body).replace('"matchLabels": {}, ', "")
        )
        return True

    def read(self, kind, name, namespace):
        self._call("read")
        return copy.deepcopy(self.policies.get(name))

    def patch(self, kind, name, namespace, patch):
        self._call("patch")
        (op,) = patch
        assert (op["op"], op["path"]) == ("replace", "/spec")
        self.policies[name]["spec"] = op["value"]

    def delete(self, kind, name, namespace):
        self._call("delete")
        self.policies.pop(name, None)


class Events:
    def __init__(self) -> None:
        self.posted: list[str] = []

    def post(self, model, type_, reason, message, once=True):
        self.posted.append(reason)


KEY = ("ml", "granite")


def step_for(kube, settings=ON, cache=None):
    cache = cache or WatchCache()
    return NetworkPolicyStep(settings, kube, Events(), cache), cache


def test_the_step_makes_repairs_once_per_generation_and_leaves_a_foreign_policy_alone():
    m = model(networkPolicy={"from": [GATEWAY]})
    spec = check_spec("granite", m["spec"], ON)
    kube = FakeKube()
    step, cache = step_for(kube)
    step.ensure(KEY, m, spec, Pass())
    assert kube.policies["granite"] == policy_of(m) and step.events.posted == ["NetworkPolicyCreated"]
    step.ensure(KEY, m, spec, Pass())  # the same generation: nothing asked
    assert kube.calls == ["create"]
    kube.policies["granite"]["spec"]["ingress"] = []  # someone opened nothing, or everything
    cache.owned_changed(KEY)  # its watch says so
    step.ensure(KEY, m, spec, Pass())
    assert kube.policies["granite"]["spec"] == policy_of(m)["spec"] and kube.calls[-1] == "patch"
    # what the API server drops (an empty field) is no change: no patch
    kube.policies["granite"]["spec"]["podSelector"]["matchExpressions"] = []
    cache.owned_changed(KEY)
    step.ensure(KEY, m, spec, Pass())
    assert kube.calls[-1] == "read"
    # a policy of the name the model does not own is a conflict, never touched
    foreign = copy.deepcopy(policy_of(m))
    foreign["metadata"]["ownerReferences"] = []
    kube = FakeKube([foreign])
    step, _ = step_for(kube)
    work = Pass()
    step.ensure(KEY, m, spec, work)
    assert work.problems[0].reason == "NetworkPolicyConflict" and work.problems[0].is_stalled
    assert kube.policies["granite"] == foreign and "patch" not in kube.calls
    # any other refusal is a problem of the pass, named after the kind
    work = Pass()
    step_for(FakeKube(refuse=403))[0].ensure(KEY, m, spec, work)
    assert work.problems[0].reason == "NetworkPolicyRejected"


def test_with_the_setting_off_the_model_policy_goes_and_none_is_asked_about_when_the_watch_saw_none():
    m = model()
    spec = check_spec("granite", m["spec"], OperatorSettings())
    kube = FakeKube([policy_of(m)])
    step, cache = step_for(kube, OperatorSettings())
    step.ensure(KEY, m, spec, Pass())
    assert kube.calls == []  # the watch has seen no policy of the model: nothing to remove, nothing asked
    cache.policy_seen(KEY, True)  # listed at start-up
    cache.owned_changed(KEY)
    step.ensure(KEY, m, spec, Pass())
    assert kube.calls == ["read", "delete"] and kube.policies == {}
    assert step.events.posted == ["NetworkPolicyDeleted"]
    foreign = copy.deepcopy(policy_of(m))
    foreign["metadata"]["ownerReferences"] = []
    kube = FakeKube([foreign])
    step, cache = step_for(kube, OperatorSettings())
    cache.policy_seen(KEY, True)
    step.ensure(KEY, m, spec, Pass())
    assert kube.calls == ["read"] and "granite" in kube.policies  # not ours: left alone


# ---- on a real control plane of its own ---------------------------------------------------------------

NS = "netpol"


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    """A control plane of its own (the session's operator watches every namespace of the shared one, with
    the setting off), the chart's RBAC, a monitoring namespace and a namespace with a kubelet stand-in."""
    ensure_k8s_binaries()
    work = tmp_path_factory.mktemp("netpol")
    cp = ControlPlane(workdir=work / "cluster")
    cp.start()
    try:
        kube = cp.api_client()
        cp.register_nodes(spyre_nodes(count=1, cards=8))
        kubectl(cp, "apply", "--validate=false", "-f", str(REPO / "crds/spyremodels.yaml"))
        kubectl(cp, "wait", "--for=condition=established", "crd/spyremodels.spyre-serve.io")
        kubectl(cp, "create", "namespace", "spyre-system")
        kubectl(cp, "apply", "-f", str(REPO / "deploy/rbac/clusterrole.yaml"))
        core = client.CoreV1Api(kube)
        # Kubernetes 1.21 and later label every namespace with its name; this 1.20 plane does not, so the
        # label is put on as a newer API server would
        for name in (NS, "monitoring"):
            core.create_namespace(
                {"metadata": {"name": name, "labels": {"kubernetes.io/metadata.name": name}}}
            )
        claim = {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}
        core.create_namespaced_persistent_volume_claim(NS, {"metadata": {"name": "models"}, "spec": claim})
        kubeconfig = service_account_kubeconfig(cp, kube, "spyre-system", "spyre-operator", work / "kc")
        with FakeKubelet(kube, NS, period=0.5) as kubelet:
            yield Namespace(NS, kube, kubelet), kubeconfig, work
    finally:
        cp.stop()


def read_policy(ns: Namespace, name: str) -> dict | None:
    try:
        api = client.NetworkingV1Api(ns.kube)
        return json.loads(api.read_namespaced_network_policy(name, NS, _preload_content=False).data)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def operator(kubeconfig, work, name: str, **env) -> OperatorProcess:
    return OperatorProcess(kubeconfig, work / f"{name}.log", env).start()


def test_the_operator_keeps_the_model_policy_on_the_api_server_and_removes_it_when_turned_off(plane):
    ns, kubeconfig, work = plane
    on = {"SPYRE_OPERATOR_NETWORK_POLICY": "1", "SPYRE_OPERATOR_MONITORING_NAMESPACE": "monitoring"}
    op = operator(kubeconfig, work, "on", **on)
    try:
        ns.apply_model(
            "granite", {**copy.deepcopy(BASE), "replicas": 2, "networkPolicy": {"from": [GATEWAY]}}
        )
        ns.wait_ready("granite", 2)
        policy = wait_for(lambda: read_policy(ns, "granite"), what="the model's NetworkPolicy")
        uid = ns.model("granite")["metadata"]["uid"]
        assert [(r["kind"], r["uid"]) for r in policy["metadata"]["ownerReferences"]] == [("SpyreModel", uid)]
        pods = ns.pods("granite")
        assert len(pods) == 2 and all(selects(policy["spec"]["podSelector"], p.metadata.labels) for p in pods)
        core = client.CoreV1Api(ns.kube)
        labels = {n: core.read_namespace(n).metadata.labels for n in (NS, "monitoring")}
        labels["default"] = {"kubernetes.io/metadata.name": "default"}  # as 1.21 and later label it
        by_port = rules_by_port(policy)
        peers = by_port[8000]
        scrapers = [
            p
            for p in peers
            if "namespaceSelector" in p and selects(p["namespaceSelector"], labels["monitoring"])
        ]
        assert len(scrapers) == 1 and not selects(scrapers[0]["namespaceSelector"], labels["default"])
        assert {"podSelector": {}} in peers and GATEWAY in peers and set(by_port) == {8000}
        # the spec changes: KV events on (continuous batching), another peer: the policy follows
        app = {"podSelector": {"matchLabels": {"app": "client"}}}
        ns.patch_spec("granite", {"batching": CB, "kvEvents": {}, "networkPolicy": {"from": [app]}})
        policy = wait_for(
            lambda: (p := read_policy(ns, "granite")) and 5557 in rules_by_port(p) and p,
            what="the policy updated",
        )
        assert (
            rules_by_port(policy)[5557] == [{"podSelector": {}}, app]
            and GATEWAY not in rules_by_port(policy)[8000]
        )
        wait_for(  # the pass's Events are posted after its writes, the policy's among them
            lambda: "NetworkPolicyUpdated" in [e.reason for e in ns.events("granite")],
            what="a NetworkPolicyUpdated Event",
        )
        # deleted by someone: its watch says so and it comes back
        client.NetworkingV1Api(ns.kube).delete_namespaced_network_policy("granite", NS)
        wait_for(lambda: read_policy(ns, "granite"), what="the policy made again")
    finally:
        op.stop()
    # the setting turned off (the chart value): the restarted operator removes the policy, the model serves on
    op = operator(kubeconfig, work, "off")
    try:
        wait_for(lambda: read_policy(ns, "granite") is None, what="the policy removed")
        # the Event and the condition are written after the delete: a loaded machine sees them a moment later
        wait_for(
            lambda: "NetworkPolicyDeleted" in [e.reason for e in ns.events("granite")],
            what="the NetworkPolicyDeleted Event",
        )
        wait_for(lambda: ns.condition("granite", "Ready")["status"] == "True", what="the model Ready")
    finally:
        op.stop()
    # on again, and the model deleted: the garbage collector takes its policy with it (ownerReference)
    op = operator(kubeconfig, work, "on-again", **on)
    try:
        wait_for(lambda: read_policy(ns, "granite"), what="the policy made again")
        ns.custom.delete_namespaced_custom_object("spyre-serve.io", "v1alpha1", NS, "spyremodels", "granite")
        wait_for(
            lambda: read_policy(ns, "granite") is None, timeout=60, what="the policy collected with the model"
        )
    finally:
        op.stop()
