"""Where a model's cards come from, as the Spyre device stack publishes them: an extended resource (the
operator's card resource, the smallest topology tier that holds the cards, or the spec's own `cardResource`:
`ibm.com/spyre_pf`, `ibm.com/spyre_vf`, `ibm.com/spyre_pf_tier0`), or Dynamic Resource Allocation
(`spec.devices`: a ResourceClaimTemplate per model asking for `cards` devices of a DeviceClass, IBM's driver
publishing `spyre-pf`, all on one NUMA node when there are several). Pure: the checks, the card request of a
pod and the device request its template makes (kinds/resource_claim_template.py builds the template)."""

from __future__ import annotations

import hashlib
import json

from spyre_operator.settings import OperatorSettings
from spyre_operator.spec.model_spec import InvalidSpec, ModelSpec
from spyre_operator.spec.pod_fields import check_card_counts

RESOURCE_API = "resource.k8s.io/v1"  # DRA, served from Kubernetes 1.34
CLAIM = "cards"  # the pod's resourceClaims entry, the container's resources.claims and the device request


class DRAUnavailable(InvalidSpec):
    """spec.devices asks for DRA and the cluster does not serve resource.k8s.io/v1."""

    reason = "DRAUnavailable"

    def __init__(self) -> None:
        super().__init__(
            "devices",
            f"asks for cards by Dynamic Resource Allocation, but this cluster does not serve {RESOURCE_API} "
            "(Kubernetes 1.34 or later): remove spec.devices to request cards by extended resource "
            "(spec.cards, spec.cardResource)",
        )


def card_resource_for(spec: ModelSpec, settings: OperatorSettings) -> str:
    """The extended resource a pod requests its cards by: the spec's cardResource; else, with tiered device
    plugins and more than one card (a tensor-parallel pod), the smallest tier whose linked cards hold `cards`
    (`<card_resource>_tier<i>`, as the Spyre operator publishes them: tier0 up to 4, tier1 up to 8, tier2 up
    to 16); else the operator's card resource (one card needs no link). Raises InvalidSpec when no tier can
    hold them."""
    if spec.card_resource:
        return spec.card_resource
    if not settings.card_tiers or spec.cards == 1:
        return settings.card_resource
    for i, size in enumerate(settings.card_tiers):
        if spec.cards <= size:
            return f"{settings.card_resource}_tier{i}"
    raise InvalidSpec(
        "cards", f"{spec.cards} cards fit no card tier of this cluster (tiers of {list(settings.card_tiers)})"
    )


def check_placement(spec: ModelSpec, settings: OperatorSettings) -> None:
    """The cards as the spec asks for them: a tier that holds them, and no card count in requests or limits
    that says otherwise than spec.cards (none at all when the cards come by DRA)."""
    resource = "" if spec.devices else card_resource_for(spec, settings)
    check_card_counts(spec.resources, resource, spec.cards, by_devices=spec.devices is not None)


def claim_template_name(name: str, spec: ModelSpec) -> str:
    """Named after what it asks for: a template's spec never changes, a new request is a new template."""
    digest = hashlib.sha256(json.dumps(device_claim(spec), sort_keys=True).encode()).hexdigest()[:10]
    return f"{name}-cards-{digest}"


def request_cards(resources: dict, name: str, spec: ModelSpec, settings: OperatorSettings) -> list[dict]:
    """Puts the cards into the container's `resources` (an extended resource's request and limit, or the
    claim's name); returns the pod's `resourceClaims` (empty without DRA)."""
    if spec.devices is None:
        resource = card_resource_for(spec, settings)
        resources.setdefault("requests", {})[resource] = str(spec.cards)
        resources.setdefault("limits", {})[resource] = str(spec.cards)
        return []
    resources["claims"] = [{"name": CLAIM}]
    return [{"name": CLAIM, "resourceClaimTemplateName": claim_template_name(name, spec)}]


def device_claim(spec: ModelSpec) -> dict:
    """`cards` devices of the DeviceClass; several share the value of the match attribute (one NUMA node)."""
    devices = spec.devices
    request = {
        "name": CLAIM,
        "exactly": {
            "deviceClassName": devices.device_class,
            "allocationMode": "ExactCount",
            "count": spec.cards,
        },
    }
    claim: dict = {"devices": {"requests": [request]}}
    if spec.cards > 1:
        claim["devices"]["constraints"] = [{"requests": [CLAIM], "matchAttribute": devices.match_attribute}]
    return claim
