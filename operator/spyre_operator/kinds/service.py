"""The model's Service: made once; its selector and ports (what the operator owns of it) restored when
someone changed them. A Service of the model's name that the model does not own is for a human to settle.
Its builder is here too."""

from __future__ import annotations

from kubernetes.client.rest import ApiException

from spyre_operator.io.events import EventRecorder
from spyre_operator.io.kube import Kube, problem_of
from spyre_operator.io.work import Pass, Problem
from spyre_operator.kinds.ownership import is_owned_by, owner_reference, selector_labels
from spyre_operator.settings import MANAGED_BY, OperatorSettings


class ServiceStep:
    def __init__(self, settings: OperatorSettings, kube: Kube, events: EventRecorder) -> None:
        self.settings = settings
        self.kube = kube
        self.events = events

    def ensure(self, model: dict, work: Pass) -> bool:
        """True when the model has its Service as it should be; else a problem in `work`."""
        want = build_service(model, self.settings)
        name, namespace = want["metadata"]["name"], want["metadata"]["namespace"]
        try:
            if self.kube.create_unless_exists(want):
                return True
            have = self.kube.read("Service", name, namespace)
            if have is None:  # removed meanwhile: the next pass makes it
                raise ApiException(status=409, reason="Service was being removed")
            if not is_owned_by(have, model):
                work.problems.append(
                    Problem(
                        "ServiceConflict",
                        f"Service {name} exists and is not owned by this SpyreModel: rename the model"
                        " or remove the Service",
                    )
                )
                return False
            patch = service_repair(have, want)
            if patch:
                self.kube.patch("Service", name, namespace, patch)
                self.events.post(
                    model, "Normal", "ServiceRepaired", f"Service {name}: selector and ports restored"
                )
            return True
        except ApiException as e:
            work.problems.append(problem_of("Service", e))
            return False


def service_repair(have: dict, want: dict) -> dict | None:
    """The patch restoring a Service's selector and ports to `want`'s; None when they are intact."""
    ports = [
        {k: p.get(k) for k in ("name", "port", "targetPort", "protocol")}
        for p in have["spec"].get("ports") or []
    ]
    if have["spec"].get("selector") == want["spec"]["selector"] and ports == want["spec"]["ports"]:
        return None
    return {"spec": {"selector": want["spec"]["selector"], "ports": want["spec"]["ports"]}}


def build_service(model: dict, settings: OperatorSettings) -> dict:
    name = model["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": model["metadata"]["namespace"],
            "labels": {**selector_labels(name), **MANAGED_BY},
            "ownerReferences": [owner_reference(model)],
        },
        "spec": {
            "selector": selector_labels(name),
            "ports": [
                {"name": "http", "port": settings.runtime_port, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }
