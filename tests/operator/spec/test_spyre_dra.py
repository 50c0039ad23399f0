"""DRA as IBM's Spyre driver publishes it (driver spyre.ibm.com, DeviceClasses spyre-pf, spyre-standard-vf,
spyre-privileged-vf), without a cluster: spec.cardResource picks the class under spec.devices (virtual
functions: spyre-standard-vf), and examples/dra-extended-resource.yaml, whose DeviceClass carries
extendedResourceName (Kubernetes 1.36, KEP 5004), so the same SpyreModel runs with the device plugin or with
DRA. The DeviceClass is checked against the published 1.36 schema (kubernetes-validate's strict 1.36:
unknown fields refused, extendedResourceName a string of DeviceClassSpec); the 1.20 test control plane serves
no DRA."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml
from spyre_operator.admission import check_spec
from spyre_operator.kinds.pods.template import build_pod
from spyre_operator.kinds.resource_claim_template import build_claim_template
from spyre_operator.settings import OperatorSettings
from spyre_operator.spec.model_spec import InvalidSpec

from tests.conftest import REPO
from tests.operator.catalog import BASE

MODEL = {
    "apiVersion": "spyre-serve.io/v1alpha1",
    "kind": "SpyreModel",
    "metadata": {"name": "granite", "namespace": "ml", "uid": "u-1", "generation": 1},
}
EXAMPLE = REPO / "examples/dra-extended-resource.yaml"


def requested_class(spec_changes: dict) -> str:
    spec = check_spec("granite", {**BASE, "cards": 2, **spec_changes}, OperatorSettings())
    template = build_claim_template({**MODEL, "spec": {}}, spec)
    return template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"]


@pytest.mark.parametrize(
    ("spec_changes", "device_class"),
    [
        ({"devices": {}}, "spyre-pf"),
        ({"devices": {}, "cardResource": "ibm.com/spyre_vf"}, "spyre-standard-vf"),
        ({"devices": {}, "cardResource": "ibm.com/spyre_pf"}, "spyre-pf"),
        ({"devices": {}, "cardResource": "ibm.com/spyre_pf_tier0"}, "spyre-pf"),
        ({"devices": {"deviceClassName": "spyre-privileged-vf"}}, "spyre-privileged-vf"),
    ],
    ids=["whole-cards", "virtual-functions", "named-whole-cards", "tier-is-whole-cards", "privileged-named"],
)
def test_the_device_class_follows_the_kind_of_card(spec_changes, device_class):
    assert requested_class(spec_changes) == device_class


def test_a_class_named_beside_a_card_resource_is_refused():
    with pytest.raises(InvalidSpec, match=r"deviceClassName and spec\.cardResource exclude each other"):
        requested_class({"devices": {"deviceClassName": "spyre-pf"}, "cardResource": "ibm.com/spyre_vf"})


def test_virtual_functions_by_dra_request_no_extended_resource():
    spec = check_spec(
        "granite", {**BASE, "devices": {}, "cardResource": "ibm.com/spyre_vf"}, OperatorSettings()
    )
    container = build_pod(MODEL, spec, OperatorSettings())["spec"]["containers"][0]
    assert container["resources"]["claims"] == [{"name": "cards"}]
    asked = [r for part in ("requests", "limits") for r in container["resources"].get(part, {})]
    assert not [r for r in asked if r.startswith("ibm.com/")]


def example() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d}


def test_the_example_device_class_validates_against_kubernetes_1_36():
    device_class = example()["DeviceClass"]
    assert device_class["spec"]["extendedResourceName"] == "ibm.com/spyre_pf"
    assert device_class["metadata"]["name"] == "spyre-pf"
    kubernetes_validate.validate(device_class, "1.36.0", strict=True)
    # the strict schema is what makes this a check: a misspelt field or a wrong type is refused
    misspelt = copy.deepcopy(device_class)
    misspelt["spec"]["extendedResourceNames"] = misspelt["spec"].pop("extendedResourceName")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, "1.36.0", strict=True)
    wrong = copy.deepcopy(device_class)
    wrong["spec"]["extendedResourceName"] = ["ibm.com/spyre_pf"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, "1.36.0", strict=True)
    # 1.33 had no resource.k8s.io/v1 at all
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(device_class, "1.33.0", strict=True)


def test_the_example_model_asks_for_what_the_device_class_serves():
    """The model's pods request the operator's card resource, the one the class carries: served by the device
    plugin where there is one, by DRA through the class where the driver is; no claim of the operator's."""
    doc = example()["SpyreModel"]
    settings = OperatorSettings()
    spec = check_spec(doc["metadata"]["name"], doc["spec"], settings)
    pod = build_pod({**MODEL, "metadata": {**MODEL["metadata"], **doc["metadata"]}}, spec, settings)
    resources = pod["spec"]["containers"][0]["resources"]
    served = example()["DeviceClass"]["spec"]["extendedResourceName"]
    assert served == settings.card_resource
    assert resources["requests"][served] == resources["limits"][served] == str(doc["spec"]["cards"])
    assert "claims" not in resources and "resourceClaims" not in pod["spec"]
    kubernetes_validate.validate(pod, "1.36.0", strict=True)
