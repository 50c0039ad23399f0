"""The scheduler of inference pods, as the cluster's Spyre stack decides it: a set name wins; otherwise
spyre-scheduler when the IBM Spyre Operator's SpyreClusterPolicy CRD is installed, else the default scheduler.
Pure for the choice; on the real control plane with and without a stand-in of that CRD
(tests/cluster/crds/spyreclusterpolicy.yaml) for the detection at the operator's start-up and its log line."""

from __future__ import annotations

import pytest
from kubernetes import client, config
from spyre_operator.io import spyre_stack
from spyre_operator.io.spyre_stack import (
    SPYRE_POLICY_CRD,
    SPYRE_SCHEDULER,
    choose_scheduler,
    resolve_scheduler,
)
from spyre_operator.settings import OperatorSettings, load_settings

from tests.conftest import REPO, wait_for
from tests.operator.conftest import service_account_kubeconfig

CRD_FILE = REPO / "tests/cluster/crds/spyreclusterpolicy.yaml"
CRD = "spyreclusterpolicies.spyre.ibm.com"
SPEC = {
    "model": {"source": "pvc://models/tiny"},
    "cards": 1,
    "replicas": 1,
    "backend": "inductor",
    "batching": {"mode": "static", "shapes": [{"promptLength": 64, "newTokens": 20, "batchSize": 1}]},
}
DETECTED = f"is installed: inference pods name the scheduler {SPYRE_SCHEDULER}"
ABSENT = (
    f"no SpyreClusterPolicy CRD ({CRD}) is installed: inference pods go to the cluster's default scheduler"
)


@pytest.mark.parametrize(
    ("given", "has_policy", "chosen", "said"),
    [
        (None, True, SPYRE_SCHEDULER, DETECTED),
        (None, False, None, ABSENT),
        (None, None, None, "may not read CustomResourceDefinitions"),
        ("aiu-scheduler", True, "aiu-scheduler", "the scheduler aiu-scheduler (SPYRE_OPERATOR_SCHEDULER"),
        ("aiu-scheduler", False, "aiu-scheduler", "name the scheduler aiu-scheduler"),
    ],
    ids=["detected", "absent", "cannot-tell", "set-wins-over-detected", "set-older-cluster"],
)
def test_the_scheduler_choice(given, has_policy, chosen, said):
    settings, line = choose_scheduler(OperatorSettings(scheduler_name=given), has_policy)
    assert settings.scheduler_name == chosen
    assert said in line


def test_the_setting_names_the_older_clusters_scheduler():
    settings = load_settings(
        {"SPYRE_OPERATOR_SCHEDULER_NAME": "aiu-scheduler", "SPYRE_OPERATOR_CARD_RESOURCE": "ibm.com/aiu_pf"}
    )
    assert (settings.scheduler_name, settings.card_resource) == ("aiu-scheduler", "ibm.com/aiu_pf")


def crd_installed(cluster) -> bool:
    return CRD in cluster.kubectl("get", "crd", "-o", "name").stdout


def restart(operator) -> None:
    operator.stop()  # a clean stop hands the Lease over at once
    operator.start()


def startup_lines(operator, text: str) -> int:
    return operator.log_path.read_text(errors="replace").count(text)


@pytest.mark.cluster
def test_spyre_scheduler_with_the_spyre_operators_crd_and_the_default_without(cluster, operator, ns):
    assert not crd_installed(cluster)
    wait_for(lambda: startup_lines(operator, ABSENT), what="the start-up line: no SpyreClusterPolicy CRD")
    ns.apply_model("plain", SPEC)
    ns.wait_ready("plain", 1)
    (pod,) = ns.pods("plain")
    assert pod.spec.scheduler_name == "default-scheduler"  # none named: the API server's default
    ns.custom.delete_namespaced_custom_object("spyre-serve.io", "v1alpha1", ns.name, "spyremodels", "plain")
    wait_for(lambda: not ns.pods("plain"), timeout=90, what="the plain model's pod gone")
    cluster.kubectl("apply", "-f", str(CRD_FILE))
    cluster.kubectl("wait", "--for=condition=established", "--timeout=60s", f"crd/{CRD}")
    absent = startup_lines(operator, ABSENT)
    try:
        restart(operator)
        wait_for(lambda: startup_lines(operator, DETECTED), timeout=60, what="the start-up line: detected")
        ns.apply_model("spyre", SPEC)
        (pod,) = wait_for(lambda: ns.pods("spyre"), timeout=60, what="the model's pod")
        # Pending: this control plane runs no such scheduler
        assert pod.spec.scheduler_name == SPYRE_SCHEDULER
        assert pod.spec.node_name is None
    finally:
        cluster.kubectl("delete", "crd", CRD, "--ignore-not-found", "--timeout=90s", check=False)
        wait_for(lambda: not crd_installed(cluster), timeout=90, what="the stand-in CRD removed")
        restart(operator)  # as it was found: the default scheduler
        wait_for(lambda: startup_lines(operator, ABSENT) > absent, timeout=60, what="back to the default")


@pytest.mark.cluster
def test_an_operator_that_may_not_read_crds_says_so_and_takes_the_default(
    cluster, kube, operator_rbac, ns, tmp_path
):
    """A namespaced install's RBAC has no CustomResourceDefinitions: the API server's 403 is "cannot tell",
    not an error; the operator's own RBAC reads them (a 404 here: no SpyreClusterPolicy CRD)."""
    client.CoreV1Api(kube).create_namespaced_service_account(ns.name, {"metadata": {"name": "no-crds"}})
    kubeconfig = service_account_kubeconfig(cluster, kube, ns.name, "no-crds", tmp_path / "kubeconfig")
    unprivileged = config.new_client_from_config(str(kubeconfig))
    assert crd_installed_by(unprivileged) is None
    assert resolve_scheduler(OperatorSettings(), unprivileged).scheduler_name is None
    operator_kubeconfig = service_account_kubeconfig(
        cluster, kube, "spyre-system", "spyre-operator", tmp_path / "operator-kubeconfig"
    )
    assert crd_installed_by(config.new_client_from_config(str(operator_kubeconfig))) is False


def crd_installed_by(api_client) -> bool | None:
    return spyre_stack.crd_installed(api_client, SPYRE_POLICY_CRD, timeout=10)
