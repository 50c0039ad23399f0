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
from spyre_operator.spec.model_spec import Tls

# OpenShift's service CA writes a serving key pair for the Service into the Secret this annotation names
SERVICE_CA_ANNOTATION = "service.beta.openshift.io/serving-cert-secret-name"


class ServiceStep:
    def __init__(self, settings: OperatorSettings, kube: Kube, events: EventRecorder) -> None:
        self.settings = settings
        self.kube = kube
        self.events = events

    def ensure(self, model: dict, work: Pass, tls: Tls | None = None) -> bool:
        """True when the model has its Service as it should be; else a problem in `work`."""
        want = build_service(model, self.settings, tls)
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
                    model,
                    "Normal",
                    "ServiceRepaired",
                    f"Service {name}: {', '.join(patch_fields(patch))} restored",
                )
            return True
        except ApiException as e:
            work.problems.append(problem_of("Service", e))
            return False


PORT_FIELDS = ("name", "port", "targetPort", "protocol", "appProtocol")


def service_repair(have: dict, want: dict) -> dict | None:
    """The patch restoring a Service's selector, ports (appProtocol None: none) and the service CA's
    annotation to `want`'s; None when they are intact."""
    patch: dict = {}
    ports = [{k: p.get(k) for k in PORT_FIELDS} for p in have["spec"].get("ports") or []]
    if have["spec"].get("selector") != want["spec"]["selector"] or ports != want["spec"]["ports"]:
        patch["spec"] = {"selector": want["spec"]["selector"], "ports": want["spec"]["ports"]}
    wanted = want["metadata"].get("annotations") or {}
    annotations = have["metadata"].get("annotations") or {}
    if any(annotations.get(k) != v for k, v in wanted.items()):
        patch["metadata"] = {"annotations": wanted}
    return patch or None


def patch_fields(patch: dict) -> list[str]:
    return [
        *(["selector and ports"] if "spec" in patch else []),
        *(["annotations"] if "metadata" in patch else []),
    ]


def build_service(model: dict, settings: OperatorSettings, tls: Tls | None = None) -> dict:
    """The model's Service; with spec.tls its port says https (appProtocol), and on OpenShift (the
    operator's setting) it asks the service CA for the key pair in spec.tls.secretName."""
    name = model["metadata"]["name"]
    annotations = {SERVICE_CA_ANNOTATION: tls.secret_name} if tls and settings.openshift_service_ca else {}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": model["metadata"]["namespace"],
            "labels": {**selector_labels(name), **MANAGED_BY},
            "ownerReferences": [owner_reference(model)],
            **({"annotations": annotations} if annotations else {}),
        },
        "spec": {
            "selector": selector_labels(name),
            "ports": [
                {
                    "name": "http",
                    "port": settings.runtime_port,
                    "targetPort": "http",
                    "protocol": "TCP",
                    "appProtocol": "https" if tls else None,
                }
            ],
        },
    }
