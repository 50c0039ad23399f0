"""The Helm chart, with the real Helm engine (helm-python-sdk binds Helm v4's Go SDK): lint, render,
schema validation of the output, install / upgrade / uninstall in the real control plane."""

from __future__ import annotations

import shutil

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from kubernetes import client

from tests.conftest import REPO, wait_for

CHART = REPO / "charts/spyre-operator"
VALUES = {
    "cardResource": "ibm.com/aiu_pf",
    "schedulerName": "aiu-scheduler",
    "cardTiers": [4, 8, 16],
    "runtimeImage": "example.org/spyre/runtime:1.2.3",
    "defaultStorageClass": "nfs",
    "logLevel": "DEBUG",
    "resources": {"requests": {"cpu": "200m", "memory": "200Mi"}, "limits": {"cpu": "2", "memory": "512Mi"}},
    "networkPolicy": {"enabled": True, "monitoringNamespace": "monitoring"},
}


def render(values: dict | None = None) -> list[dict]:
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values or {}, name="spyre", namespace="spyre-system")
    docs = []
    for path, text in out.items():
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def env_of(deployment: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


@pytest.mark.parametrize("values", [{}, VALUES, {"watchNamespaces": ["team-a", "team-b"]}])
def test_lint_is_clean(values):
    report = helm.lint(str(CHART), values, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("values", [{}, VALUES, {"watchNamespaces": ["team-a", "team-b"]}])
@pytest.mark.parametrize("kube_version", ["1.25.0", kubernetes_validate.latest_version()])
def test_rendered_manifests_validate_against_kubernetes_schemas(values, kube_version):
    docs = render(values)
    assert {d["kind"] for d in docs} >= {"Deployment", "ServiceAccount", "ClusterRole"}
    for doc in docs:
        kubernetes_validate.validate(doc, kube_version, strict=True)


# The CRD's CEL rules use the quantity library and a rule's fieldPath: Kubernetes 1.29 compiles them (and the
# 1.36 CRD server does, tests/test_crd_server.py); clusters older than 1.25 ignore CEL (applied with
# --validate=false, the operator enforces every rule).
@pytest.mark.parametrize("kube_version", ["1.29.0", kubernetes_validate.latest_version()])
def test_the_crd_validates_against_kubernetes_schemas(kube_version):
    for path in (REPO / "crds/spyremodels.yaml", CHART / "crds/spyremodels.yaml"):
        kubernetes_validate.validate(yaml.safe_load(path.read_text()), kube_version, strict=True)
    assert (REPO / "crds/spyremodels.yaml").read_text() == (CHART / "crds/spyremodels.yaml").read_text()


def test_values_reach_the_operator():
    docs = render(VALUES)
    deployment = by_kind(docs, "Deployment")[0]
    env = env_of(deployment)
    assert env["SPYRE_OPERATOR_CARD_RESOURCE"] == "ibm.com/aiu_pf"
    assert env["SPYRE_OPERATOR_SCHEDULER_NAME"] == "aiu-scheduler"
    assert env["SPYRE_OPERATOR_CARD_TIERS"] == "4,8,16"
    defaults = env_of(by_kind(render(), "Deployment")[0])
    # no tiers and no scheduler unless set: the operator then detects the Spyre operator's scheduler
    assert "SPYRE_OPERATOR_CARD_TIERS" not in defaults and "SPYRE_OPERATOR_SCHEDULER_NAME" not in defaults
    assert env["SPYRE_OPERATOR_RUNTIME_IMAGE"] == "example.org/spyre/runtime:1.2.3"
    assert env["SPYRE_OPERATOR_DEFAULT_STORAGE_CLASS"] == "nfs"
    pod = deployment["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["args"][:2] == ["--log-level", "DEBUG"] and c["resources"] == VALUES["resources"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False and c["securityContext"]["capabilities"][
        "drop"
    ] == ["ALL"]
    assert (
        pod["securityContext"]["runAsNonRoot"] is True
        and pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    )
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and c["readinessProbe"]
    namespaced = render({"watchNamespaces": ["team-a", "team-b"]})
    assert env_of(by_kind(namespaced, "Deployment")[0])["SPYRE_OPERATOR_NAMESPACES"] == "team-a,team-b"
    roles = sorted(r["metadata"]["namespace"] for r in by_kind(namespaced, "Role"))
    assert roles == ["spyre-system", "team-a", "team-b"]  # + the Lease's Role
    assert not [
        r for r in by_kind(namespaced, "ClusterRole") if r["metadata"]["name"] == "spyre-spyre-operator"
    ]


def named(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in by_kind(docs, kind) if d["metadata"]["name"] == name]
    return doc


def test_chart_rbac_is_the_tested_least_privilege_rbac():
    reference = [d for d in yaml.safe_load_all((REPO / "deploy/rbac/clusterrole.yaml").read_text()) if d]
    docs = render()
    assert (
        named(docs, "ClusterRole", "spyre-spyre-operator")["rules"]
        == named(reference, "ClusterRole", "spyre-operator")["rules"]
    )
    lease_rules = named(reference, "Role", "spyre-operator-leader-election")["rules"]
    assert named(docs, "Role", "spyre-spyre-operator-leader-election")["rules"] == lease_rules
    namespaced_ref = [d for d in yaml.safe_load_all((REPO / "deploy/rbac/role.yaml").read_text()) if d]
    ns_role = [
        r for r in by_kind(render({"watchNamespaces": ["x"]}), "Role") if r["metadata"]["namespace"] == "x"
    ]
    assert ns_role[0]["rules"] + lease_rules == by_kind(namespaced_ref, "Role")[0]["rules"]
    aggregate = [d for d in yaml.safe_load_all((REPO / "deploy/rbac/aggregate.yaml").read_text()) if d]
    assert [r["rules"] for r in by_kind(aggregate, "ClusterRole")] == [
        named(docs, "ClusterRole", f"spyre-spyre-operator-{n}")["rules"] for n in ("edit", "view")
    ]


def test_inference_pool_value_reaches_the_operator_and_its_rbac():
    assert "SPYRE_OPERATOR_INFERENCE_POOL" not in env_of(by_kind(render(), "Deployment")[0])
    env = env_of(by_kind(render({"inferencePool": {"enabled": True}}), "Deployment")[0])
    assert env["SPYRE_OPERATOR_INFERENCE_POOL"] == "1"
    for docs, kind in ((render(), "ClusterRole"), (render({"watchNamespaces": ["x"]}), "Role")):
        rules = [r for role in by_kind(docs, kind) for r in role["rules"]]
        pools = [r for r in rules if r["apiGroups"] == ["inference.networking.k8s.io"]]
        assert [(r["resources"], r["verbs"]) for r in pools] == [
            (["inferencepools"], ["get", "list", "watch", "create", "patch", "delete"])
        ]


def test_network_policy_values_reach_the_operator_and_its_rbac():
    env = env_of(by_kind(render({"networkPolicy": {"monitoringNamespace": "monitoring"}}), "Deployment")[0])
    assert "SPYRE_OPERATOR_NETWORK_POLICY" not in env and "SPYRE_OPERATOR_MONITORING_NAMESPACE" not in env
    on = {"networkPolicy": {"enabled": True, "monitoringNamespace": "monitoring"}}
    env = env_of(by_kind(render(on), "Deployment")[0])
    assert env["SPYRE_OPERATOR_NETWORK_POLICY"] == "1"
    assert env["SPYRE_OPERATOR_MONITORING_NAMESPACE"] == "monitoring"
    env = env_of(by_kind(render({"networkPolicy": {"enabled": True}}), "Deployment")[0])
    assert "SPYRE_OPERATOR_MONITORING_NAMESPACE" not in env  # none by default: only the model's namespace
    # the values the operator reads them as
    from spyre_operator.settings import ENV, load_settings

    settings = load_settings(
        {
            k: v
            for k, v in env_of(by_kind(render(on), "Deployment")[0]).items()
            if k in ENV.values() and v is not None
        }
    )
    assert settings.network_policy and settings.monitoring_namespace == "monitoring"
    for docs, kind in ((render(), "ClusterRole"), (render({"watchNamespaces": ["x"]}), "Role")):
        rules = [r for role in by_kind(docs, kind) for r in role["rules"]]
        policies = [r for r in rules if r["apiGroups"] == ["networking.k8s.io"]]
        assert [(r["resources"], r["verbs"]) for r in policies] == [
            (["networkpolicies"], ["get", "list", "watch", "create", "patch", "delete"])
        ]


def test_ha_probes_pdb_metrics_and_no_fixed_user():
    docs = render({"metrics": {"serviceMonitor": True, "runtimePodAnnotations": True}})
    deployment = by_kind(docs, "Deployment")[0]
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    c = pod["containers"][0]
    env = env_of(deployment)
    assert (
        env["SPYRE_OPERATOR_LEADER_ELECTION"] == "1" and env["SPYRE_OPERATOR_PROMETHEUS_ANNOTATIONS"] == "1"
    )
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert "runAsUser" not in pod["securityContext"] and "SPYRE_OPERATOR_RUN_AS_USER" not in env
    assert by_kind(docs, "PodDisruptionBudget")[0]["spec"]["minAvailable"] == 1
    assert by_kind(docs, "ServiceMonitor")[0]["spec"]["endpoints"][0]["path"] == "/metrics"
    pinned = render({"runtimePodSecurityContext": {"runAsUser": 1000, "fsGroup": 2000}})
    env = env_of(by_kind(pinned, "Deployment")[0])
    assert (env["SPYRE_OPERATOR_RUN_AS_USER"], env["SPYRE_OPERATOR_FS_GROUP"]) == ("1000", "2000")
    # an OpenShift-range uid stays an integer (Helm reads numbers as floats: it printed 1.00065e+09)
    big = render({"runtimePodSecurityContext": {"runAsUser": 1000650000, "fsGroup": 1000650000}})
    env = env_of(by_kind(big, "Deployment")[0])
    assert (env["SPYRE_OPERATOR_RUN_AS_USER"], env["SPYRE_OPERATOR_FS_GROUP"]) == ("1000650000",) * 2
    extra = [{"name": "KUBERNETES_SERVICE_HOST", "value": "10.0.0.1"}]
    host = render({"hostNetwork": True, "extraEnv": extra})
    pod = by_kind(host, "Deployment")[0]["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert env_of(by_kind(host, "Deployment")[0])["KUBERNETES_SERVICE_HOST"] == "10.0.0.1"
    assert env_of(by_kind(host, "Deployment")[0])["SPYRE_OPERATOR_HEALTH_PORT"] == "8080"
    moved = by_kind(render({"hostNetwork": True, "healthPort": 18080}), "Deployment")[0]
    assert env_of(moved)["SPYRE_OPERATOR_HEALTH_PORT"] == "18080"
    assert moved["spec"]["template"]["spec"]["containers"][0]["ports"] == [
        {"name": "health", "containerPort": 18080}
    ]
    assert not by_kind(render({"replicas": 1}), "PodDisruptionBudget")


def chart_without_crds(tmp_path) -> str:
    """`helm install --skip-crds`, by construction: the chart with its crds/ folder left out. The 1.20 API
    server cannot server-side-apply (Helm 4's way) a CRD that carries CEL rules, since its typed schema
    lacks x-kubernetes-validations; on such clusters the CRD is applied first with kubectl (the `crd`
    fixture does), as the chart's NOTES say."""
    copy = tmp_path / "spyre-operator"
    shutil.copytree(CHART, copy, symlinks=False, ignore=shutil.ignore_patterns("crds"))
    return str(copy)


@pytest.mark.cluster
def test_install_upgrade_uninstall(cluster, kube, crd, tmp_path):
    apps, core, rbac = client.AppsV1Api(kube), client.CoreV1Api(kube), client.RbacAuthorizationV1Api(kube)
    ns = "spyre-helm"
    cfg = helm.Config(kubeconfig_path=str(cluster.kubeconfig), namespace=ns)
    try:
        chart = chart_without_crds(tmp_path)
        rel = cfg.install(
            chart,
            "spyre",
            {"cardResource": "ibm.com/spyre_pf"},
            namespace=ns,
            create_namespace=True,
            timeout=120,
        )
        assert (rel["revision"], rel["status"]) == (1, "deployed")
        deployment = apps.read_namespaced_deployment("spyre-spyre-operator", ns)
        env = {e.name: e.value for e in deployment.spec.template.spec.containers[0].env}
        assert env["SPYRE_OPERATOR_CARD_RESOURCE"] == "ibm.com/spyre_pf"
        assert core.read_namespaced_service_account("spyre-spyre-operator", ns)
        assert rbac.read_cluster_role("spyre-spyre-operator").rules

        rel = cfg.upgrade(chart, "spyre", {"cardResource": "ibm.com/aiu_pf"}, namespace=ns, timeout=120)
        assert (rel["revision"], rel["status"]) == (2, "deployed")
        deployment = apps.read_namespaced_deployment("spyre-spyre-operator", ns)
        env = {e.name: e.value for e in deployment.spec.template.spec.containers[0].env}
        assert env["SPYRE_OPERATOR_CARD_RESOURCE"] == "ibm.com/aiu_pf"
        assert deployment.metadata.generation == 2
    finally:
        cfg.uninstall("spyre", ignore_not_found=True, timeout=120)
    wait_for(lambda: not apps.list_namespaced_deployment(ns).items, what="the Deployment removed")
    assert not [r for r in rbac.list_cluster_role().items if r.metadata.name == "spyre-spyre-operator"]
    # Helm never deletes (or upgrades) a chart's CRDs: the SpyreModel API and its objects survive
    assert client.ApiextensionsV1Api(kube).read_custom_resource_definition("spyremodels.spyre-serve.io")
    cfg.close()
