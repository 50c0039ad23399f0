"""What every owned object carries: the model's owner reference (so the garbage collector removes it with the
model), how to tell an object is the model's, and the labels that select the model's objects."""

from __future__ import annotations

from spyre_operator.settings import GROUP, KIND, MODEL_LABEL, VERSION


def owner_reference(model: dict) -> dict:
    meta = model["metadata"]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def is_owned_by(obj: dict, model: dict) -> bool:
    uid = model["metadata"]["uid"]
    return any(r.get("uid") == uid for r in obj["metadata"].get("ownerReferences") or [])


def selector_labels(name: str) -> dict[str, str]:
    return {MODEL_LABEL: name}
