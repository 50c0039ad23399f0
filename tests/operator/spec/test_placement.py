"""Spyre placement as the device stack publishes it, without a cluster: the card resource per model (the
operator's, its topology tier, or spec.cardResource), Dynamic Resource Allocation (a ResourceClaimTemplate per
model, the pod's claim), both validated against the published Kubernetes schemas (kubernetes-validate: DRA's
resource.k8s.io/v1 from 1.34 on), and the step that keeps the templates."""

from __future__ import annotations

import re
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml
from kubernetes.client.rest import ApiException
from spyre_contract.image_reference import REFERENCE
from spyre_operator.admission import check_spec
from spyre_operator.io.work import Pass
from spyre_operator.kinds.pods.observe import observe_pod
from spyre_operator.kinds.pods.template import build_pod
from spyre_operator.kinds.resource_claim_template import ResourceClaimTemplateStep, build_claim_template
from spyre_operator.settings import HASH_LABEL, OperatorSettings, SettingsError, load_settings
from spyre_operator.spec.model_spec import InvalidSpec
from spyre_operator.spec.parse import parse_spec
from spyre_operator.spec.placement import card_resource_for

from tests.conftest import REPO
from tests.operator.catalog import BASE

MODEL = {
    "apiVersion": "spyre-serve.io/v1alpha1",
    "kind": "SpyreModel",
    "metadata": {"name": "granite", "namespace": "ml", "uid": "u-1", "generation": 1},
}
# the releases that serve DRA's resource.k8s.io/v1, as far as the installed kubernetes-validate knows them
DRA_VERSIONS = [
    v
    for v in ("1.34.0", "1.35.0", "1.36.0", kubernetes_validate.latest_version())
    if tuple(map(int, v.split(".")[:2]))
    <= tuple(map(int, kubernetes_validate.latest_version().split(".")[:2]))
]


def container(pod: dict) -> dict:
    return pod["spec"]["containers"][0]


@pytest.mark.parametrize(
    ("spec_changes", "settings", "resource"),
    [
        ({}, OperatorSettings(), "ibm.com/spyre_pf"),
        ({"cardResource": "ibm.com/spyre_vf"}, OperatorSettings(), "ibm.com/spyre_vf"),
        ({"cards": 4}, OperatorSettings(card_tiers=(4, 8)), "ibm.com/spyre_pf_tier0"),
        ({"cards": 1}, OperatorSettings(card_tiers=(4, 8, 16)), "ibm.com/spyre_pf"),
        ({"cards": 2}, OperatorSettings(card_tiers=(4, 8, 16)), "ibm.com/spyre_pf_tier0"),
        ({"cards": 8}, OperatorSettings(card_tiers=(4, 8, 16)), "ibm.com/spyre_pf_tier1"),
        (
            {"cards": 8, "cardResource": "ibm.com/spyre_pf"},
            OperatorSettings(card_tiers=(4, 8)),
            "ibm.com/spyre_pf",
        ),
    ],
    ids=[
        "operator-default",
        "spec-virtual-functions",
        "topology-tier",
        "one-card-untiered",
        "two-cards-tier0",
        "eight-cards-tier1",
        "spec-overrides-tiers",
    ],
)
def test_the_card_resource_per_model(spec_changes, settings, resource):
    spec = check_spec("granite", {**BASE, **spec_changes}, settings)
    assert card_resource_for(spec, settings) == resource
    pod = build_pod(MODEL, spec, settings)
    cards = str(spec.cards)
    assert (
        container(pod)["resources"]["requests"][resource]
        == cards
        == container(pod)["resources"]["limits"][resource]
    )
    assert "resourceClaims" not in pod["spec"]
    kubernetes_validate.validate(pod, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("cards", [1, 4])
def test_cards_by_dra_make_a_claim_template_and_the_pod_claims_from_it(cards):
    spec = check_spec("granite", {**BASE, "cards": cards, "devices": {}}, OperatorSettings())
    template = build_claim_template({**MODEL, "spec": {}}, spec)
    request = template["spec"]["spec"]["devices"]["requests"][0]
    assert request == {
        "name": "cards",
        "exactly": {"deviceClassName": "spyre-pf", "allocationMode": "ExactCount", "count": cards},
    }
    constraints = template["spec"]["spec"]["devices"].get("constraints")
    assert constraints == (
        [{"requests": ["cards"], "matchAttribute": "spyre.ibm.com/numaInfo"}] if cards > 1 else None
    )
    assert template["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert template["metadata"]["labels"]["spyre-serve.io/model"] == "granite"
    pod = build_pod(MODEL, spec, OperatorSettings())
    assert pod["spec"]["resourceClaims"] == [
        {"name": "cards", "resourceClaimTemplateName": template["metadata"]["name"]}
    ]
    assert container(pod)["resources"]["claims"] == [{"name": "cards"}]
    assert not any(
        "ibm.com" in r for part in ("requests", "limits") for r in container(pod)["resources"].get(part, {})
    )
    assert container(pod)["args"][container(pod)["args"].index("--tensor-parallel-size") + 1] == str(cards)
    assert DRA_VERSIONS and DRA_VERSIONS[0] == "1.34.0"
    for version in DRA_VERSIONS:
        kubernetes_validate.validate(template, version, strict=True)
        kubernetes_validate.validate(pod, version, strict=True)
    # 1.33 has no resource.k8s.io/v1: the reason the operator asks the cluster before it makes one
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(template, "1.33.0", strict=True)


def test_a_claim_template_is_named_after_what_it_asks_for():
    def name(**changes):
        spec = check_spec("granite", {**BASE, "devices": {}, **changes}, OperatorSettings())
        return build_claim_template({**MODEL, "spec": {}}, spec)["metadata"]["name"]

    assert (
        name() == name() != name(cards=2) != name(cards=2, devices={"deviceClassName": "spyre-standard-vf"})
    )
    assert re.match(r"^granite-cards-[0-9a-f]{10}$", name())


def test_a_card_count_in_resources_must_say_what_cards_says():
    settings = OperatorSettings(card_resource="example.com/cards")
    same = {**BASE, "cards": 2, "resources": {"limits": {"ibm.com/spyre_pf": 2, "example.com/cards": "2"}}}
    check_spec("m", same, settings)
    with pytest.raises(
        InvalidSpec, match=r"spec\.resources\.requests\.example\.com/cards: asks for 500m cards"
    ):
        check_spec("m", {**BASE, "resources": {"requests": {"example.com/cards": "500m"}}}, settings)
    # the operator's tier is a card resource too
    tiered = OperatorSettings(card_tiers=(4, 8))
    with pytest.raises(InvalidSpec, match=r"spyre_pf_tier1: asks for 4 cards but spec\.cards is 8"):
        check_spec(
            "m", {**BASE, "cards": 8, "resources": {"limits": {"ibm.com/spyre_pf_tier1": "4"}}}, tiered
        )


class FakeKube:
    """The calls ResourceClaimTemplateStep makes, on a dict of templates; `refuse` answers every call with
    that status."""

    def __init__(self, templates=(), refuse: int | None = None) -> None:
        self.templates = {t["metadata"]["name"]: t for t in templates}
        self.refuse = refuse
        self.calls: list[tuple[str, str]] = []

    def _call(self, verb, name=""):
        self.calls.append((verb, name))
        if self.refuse:
            raise ApiException(status=self.refuse, reason="Not Found")

    def list(self, kind, namespace, selector):
        self._call("list")
        return list(self.templates.values())

    def create_unless_exists(self, body):
        self._call("create", body["metadata"]["name"])
        self.templates[body["metadata"]["name"]] = body
        return True

    def delete(self, kind, name, namespace):
        self._call("delete", name)
        self.templates.pop(name, None)


class Events:
    def __init__(self) -> None:
        self.posted = []

    def post(self, model, type_, reason, message, once=True):
        self.posted.append((reason, message))


def test_the_card_claim_step_keeps_one_template_per_request_and_what_pods_still_claim():
    model = {**MODEL, "spec": {}}
    old_spec = check_spec("granite", {**BASE, "cards": 2, "devices": {}}, OperatorSettings())
    new_spec = check_spec("granite", {**BASE, "cards": 4, "devices": {}}, OperatorSettings())
    older = build_claim_template(model, check_spec("granite", {**BASE, "devices": {}}, OperatorSettings()))
    old = build_claim_template(model, old_spec)
    foreign = {"metadata": {"name": "granite-cards-foreign", "ownerReferences": [{"uid": "other"}]}}
    kube, events = FakeKube([older, old, foreign]), Events()
    serving = {
        "spec": {"resourceClaims": [{"name": "cards", "resourceClaimTemplateName": old["metadata"]["name"]}]}
    }
    work = Pass()
    assert ResourceClaimTemplateStep(OperatorSettings(), kube, events).ensure(
        model, new_spec, [serving], work
    )
    new = build_claim_template(model, new_spec)["metadata"]["name"]
    # the new one made, the old one kept while a pod claims from it, the older one (and only ours) removed
    assert set(kube.templates) == {new, old["metadata"]["name"], "granite-cards-foreign"}
    assert ("delete", older["metadata"]["name"]) in kube.calls and not work.problems
    assert events.posted == [("ClaimTemplateCreated", f"ResourceClaimTemplate {new}: 4 devices of spyre-pf")]
    # nothing asked without DRA (a cluster without it would answer 404), and a refusal is a problem
    kube = FakeKube(refuse=404)
    assert ResourceClaimTemplateStep(OperatorSettings(), kube, events).ensure(
        model, parse_spec("granite", BASE), [], Pass()
    )
    assert kube.calls == []
    work = Pass()
    assert not ResourceClaimTemplateStep(OperatorSettings(), kube, events).ensure(model, new_spec, [], work)
    assert work.problems[0].reason == "ResourceClaimTemplateRejected" and work.problems[0].is_stalled


def test_a_pod_waiting_for_devices_lacks_cards():
    pod = {
        "metadata": {"name": "p", "labels": {HASH_LABEL: "h"}, "creationTimestamp": "2026-11-25T12:00:00Z"},
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 3 cannot allocate all claims.",
                }
            ],
        },
    }
    view, health = observe_pod(pod, "ibm.com/spyre_pf", HASH_LABEL)
    assert view.lacks_cards and not health.is_started and not health.node


def test_the_crd_checks_an_image_as_the_operator_and_the_kubelet_do():
    """One grammar in two places: the CRD's CEL rule is image_reference's expression."""
    crd = yaml.safe_load((REPO / "crds/spyremodels.yaml").read_text())
    image = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "image"
    ]
    rule = image["x-kubernetes-validations"][0]["rule"]
    assert rule == f"self.matches(r'{re.sub(r'[(][?]P<[a-z]+>', '(?:', REFERENCE.pattern)}')"


def test_the_runtime_image_setting_is_checked_at_start_up():
    with pytest.raises(
        SettingsError, match=r"SPYRE_OPERATOR_RUNTIME_IMAGE='Quay\.io/runtime 1' is not an image"
    ):
        load_settings({"SPYRE_OPERATOR_RUNTIME_IMAGE": "Quay.io/runtime 1"})
    done = subprocess.run(
        [sys.executable, "-m", "spyre_operator", "--runtime-image", "quay.io/spyre/Runtime:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "spyre-operator: error: --runtime-image='quay.io/spyre/Runtime:1' is not an image reference a "
        'kubelet can pull: couldn\'t parse image reference "quay.io/spyre/Runtime:1": invalid reference '
        "format: repository name must be lowercase"
    ]
