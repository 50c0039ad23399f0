"""The card claim of a model whose cards come by Dynamic Resource Allocation (spec.devices): one
ResourceClaimTemplate (resource.k8s.io/v1) per request, named after it (a template never changes: a new card
count or DeviceClass is a new template), owned by the model; each pod claims from it. Templates of earlier
requests are removed once no pod claims from them (after a change to extended resources, the model's
deletion removes them)."""

from __future__ import annotations

from kubernetes.client.rest import ApiException

from spyre_operator.io.events import EventRecorder
from spyre_operator.io.kube import Kube, problem_of
from spyre_operator.io.work import Pass
from spyre_operator.kinds.ownership import is_owned_by, owner_reference, selector_labels
from spyre_operator.settings import MANAGED_BY, MODEL_LABEL, OperatorSettings
from spyre_operator.spec.model_spec import ModelSpec
from spyre_operator.spec.placement import RESOURCE_API, claim_template_name, device_claim


class ResourceClaimTemplateStep:
    def __init__(self, settings: OperatorSettings, kube: Kube, events: EventRecorder) -> None:
        self.settings = settings
        self.kube = kube
        self.events = events

    def ensure(self, model: dict, spec: ModelSpec, pods: list[dict], work: Pass) -> bool:
        """True when the pods can claim their cards (the template is there, or none is wanted); else a
        problem in `work`."""
        want = build_claim_template(model, spec)
        if want is None:  # clusters without DRA answer 404 to any question about it
            return True
        meta = model["metadata"]
        try:
            templates = self.kube.list(
                "ResourceClaimTemplate", meta["namespace"], f"{MODEL_LABEL}={meta['name']}"
            )
            names = {t["metadata"]["name"] for t in templates}
            current = want["metadata"]["name"]
            if current not in names and self.kube.create_unless_exists(want):
                what = f"ResourceClaimTemplate {current}: {spec.cards} devices of {spec.devices.device_class}"
                self.events.post(model, "Normal", "ClaimTemplateCreated", what)
            for name in sorted(names - {current} - claimed_templates(pods)):
                if any(is_owned_by(t, model) for t in templates if t["metadata"]["name"] == name):
                    self.kube.delete("ResourceClaimTemplate", name, meta["namespace"])
        except ApiException as e:
            work.problems.append(problem_of("ResourceClaimTemplate", e))
            return False
        return True


def claimed_templates(pods: list[dict]) -> set[str]:
    """The templates the pods (not terminated) claim their cards from."""
    return {
        claim.get("resourceClaimTemplateName")
        for pod in pods
        if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        for claim in (pod.get("spec") or {}).get("resourceClaims") or []
        if claim.get("resourceClaimTemplateName")
    }


def build_claim_template(model: dict, spec: ModelSpec) -> dict | None:
    """The ResourceClaimTemplate of a model whose cards come by DRA (spec.devices); None otherwise."""
    if spec.devices is None:
        return None
    name = model["metadata"]["name"]
    meta = {
        "namespace": model["metadata"]["namespace"],
        "labels": {**selector_labels(name), **MANAGED_BY},
        "ownerReferences": [owner_reference(model)],
    }
    return {
        "apiVersion": RESOURCE_API,
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": claim_template_name(name, spec), **meta},
        "spec": {"spec": device_claim(spec)},
    }
