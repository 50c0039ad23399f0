"""The graph-cache claim (one per model, shared by its replicas): made once; grown and its ownership set
(spec.graphCache.retention) in place; what a claim cannot change (class, access modes, a smaller size) is
reported for a human to replace it. A claim of the name that belongs to another object is not touched."""

from __future__ import annotations

from kubernetes.client.rest import ApiException

from spyre_operator.io.events import EventRecorder
from spyre_operator.io.kube import Kube, problem_of
from spyre_operator.io.work import Pass, Problem
from spyre_operator.kinds.ownership import is_owned_by, owner_reference, selector_labels
from spyre_operator.settings import MANAGED_BY, MODEL_LABEL, OperatorSettings
from spyre_operator.spec.model_spec import ModelSpec, quantity_bytes


def cache_claim_name(name: str, spec: ModelSpec) -> str | None:
    if not spec.cache.enabled:
        return None
    return spec.cache.existing_claim or f"{name}-graph-cache"


def build_cache_claim(model: dict, spec: ModelSpec, settings: OperatorSettings) -> dict | None:
    """One claim per model, shared by all replicas. None when disabled or an existing claim is used.
    With retention Delete the claim is owned by the model (garbage-collected with it); Retain keeps it."""
    if not spec.cache.enabled or spec.cache.existing_claim:
        return None
    name = model["metadata"]["name"]
    meta = {
        "name": cache_claim_name(name, spec),
        "namespace": model["metadata"]["namespace"],
        "labels": {**selector_labels(name), **MANAGED_BY},
    }
    if spec.cache.retention == "Delete":
        meta["ownerReferences"] = [owner_reference(model)]
    claim_spec = {
        "accessModes": [spec.cache.access_mode],
        "resources": {"requests": {"storage": spec.cache.size}},
    }
    storage_class = spec.cache.storage_class or settings.default_storage_class
    if storage_class:
        claim_spec["storageClassName"] = storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": claim_spec}


class GraphCacheClaimStep:
    def __init__(self, settings: OperatorSettings, kube: Kube, events: EventRecorder) -> None:
        self.settings = settings
        self.kube = kube
        self.events = events

    def ensure(self, model: dict, spec: ModelSpec, work: Pass) -> bool:
        """True when the pods can mount their claim (made, or none wanted); else a problem in `work`."""
        want = build_cache_claim(model, spec, self.settings)
        if want is None:
            return True
        name, namespace = want["metadata"]["name"], want["metadata"]["namespace"]
        try:
            if self.kube.create_unless_exists(want):
                return True
            have = self.kube.read("PersistentVolumeClaim", name, namespace)
            if have is None:
                raise ApiException(status=409, reason="claim was being removed")
            if not is_ours(have, model):
                work.problems.append(
                    Problem(
                        "ClaimConflict",
                        f"PersistentVolumeClaim {name} exists and belongs to another object: set "
                        "graphCache.existingClaim to use it, or remove it",
                    )
                )
                return False
            patch = claim_update(have, want, spec)
            if patch:
                self.kube.patch("PersistentVolumeClaim", name, namespace, patch)
                self.events.post(model, "Normal", "ClaimUpdated", f"claim {name}: {sorted(patch)} updated")
            mismatch = claim_mismatch(have, want, spec)
            if mismatch:
                work.problems.append(
                    Problem(
                        "ClaimNeedsReplacement",
                        f"claim {name} has {', '.join(mismatch)}: delete the claim to have it recreated",
                    )
                )
            return True
        except ApiException as e:
            work.problems.append(problem_of("PersistentVolumeClaim", e))
            return False


def is_ours(have: dict, model: dict) -> bool:
    """The claim carries the model's labels, and its owner (if it has one) is the model."""
    labels = have["metadata"].get("labels") or {}
    owners = have["metadata"].get("ownerReferences") or []
    labelled = labels.get(MODEL_LABEL) == model["metadata"]["name"] and all(
        labels.get(k) == v for k, v in MANAGED_BY.items()
    )
    return labelled and not (owners and not is_owned_by(have, model))


def claim_update(have: dict, want: dict, spec: ModelSpec) -> dict:
    """What changes in place: a larger size, and the owner reference (retention Delete: owned by the
    model)."""
    patch: dict = {}
    if quantity_bytes(spec.cache.size) > quantity_bytes(have["spec"]["resources"]["requests"]["storage"]):
        patch["spec"] = {"resources": {"requests": {"storage": spec.cache.size}}}
    want_owned = spec.cache.retention == "Delete"
    if want_owned != bool(have["metadata"].get("ownerReferences")):
        patch["metadata"] = {"ownerReferences": want["metadata"].get("ownerReferences", [])}
    return patch


def claim_mismatch(have: dict, want: dict, spec: ModelSpec) -> list[str]:
    """What only a new claim can change: its storage class, its access modes, a smaller size."""
    have_size = have["spec"]["resources"]["requests"]["storage"]
    want_class = want["spec"].get("storageClassName")
    mismatch = []
    if want_class and have["spec"].get("storageClassName") != want_class:
        mismatch.append(f"storage class {have['spec'].get('storageClassName')} (spec: {want_class})")
    if have["spec"].get("accessModes") != want["spec"]["accessModes"]:
        mismatch.append(
            f"access modes {have['spec'].get('accessModes')} (spec: {want['spec']['accessModes']})"
        )
    if quantity_bytes(spec.cache.size) < quantity_bytes(have_size):
        mismatch.append(f"size {have_size} (spec: {spec.cache.size}; claims do not shrink)")
    return mismatch
