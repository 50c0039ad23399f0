"""What a kubelet checks before it starts a container, for both stand-ins (the status-only FakeKubelet and the
process-running PodRunner). A pod that fails a check stays Pending with its container waiting, the reason and
message a kubelet gives, and is checked again on the next pass (a Secret created later lets it start):

- `InvalidImageName`: the image reference does not parse;
- `ErrImagePull`: the test marked the image unpullable (there is no registry here);
- `CreateContainerConfigError`: an env `valueFrom` or `envFrom` names a Secret or ConfigMap (or a key of one)
  that does not exist and is not `optional`.
"""

from __future__ import annotations

from kubernetes import client
from kubernetes.client.rest import ApiException
from spyre_contract.image_reference import image_reference_error


def _missing(core: client.CoreV1Api, kind: str, namespace: str, name: str, key: str | None) -> str | None:
    read = core.read_namespaced_secret if kind == "Secret" else core.read_namespaced_config_map
    try:
        obj = read(name, namespace)
    except ApiException as e:
        if e.status == 404:
            return f'{kind.lower()} "{name}" not found'
        raise
    data = {**(obj.data or {}), **(getattr(obj, "binary_data", None) or {})}
    if key is not None and key not in data:
        return f"couldn't find key {key} in {kind} {namespace}/{name}"
    return None


def config_error(core: client.CoreV1Api, pod, container) -> str | None:
    """The kubelet's message for the first env source of `container` that cannot be resolved, else None."""
    ns = pod.metadata.namespace
    for env in container.env or []:
        source = env.value_from
        if source is None:
            continue
        for kind, ref in (("Secret", source.secret_key_ref), ("ConfigMap", source.config_map_key_ref)):
            if (
                ref is not None
                and not ref.optional
                and (message := _missing(core, kind, ns, ref.name, ref.key))
            ):
                return message
    for env_from in container.env_from or []:
        for kind, ref in (("Secret", env_from.secret_ref), ("ConfigMap", env_from.config_map_ref)):
            if ref is not None and not ref.optional and (message := _missing(core, kind, ns, ref.name, None)):
                return message
    return None


def start_blocker(core: client.CoreV1Api, pod, unpullable: set[str]) -> tuple[str, str, str] | None:
    """(container name, waiting reason, message) of the first container that a kubelet would not start."""
    for c in pod.spec.containers:
        if error := image_reference_error(c.image or ""):
            return c.name, "InvalidImageName", f'Failed to apply default image tag "{c.image}": {error}'
        if c.image in unpullable:
            reference = f'failed to resolve reference "{c.image}": not found'
            return c.name, "ErrImagePull", f'failed to pull and unpack image "{c.image}": {reference}'
        if message := config_error(core, pod, c):
            return c.name, "CreateContainerConfigError", message
    return None


def waiting_status(pod, container: str, reason: str, message: str, now: str) -> dict:
    """The status a kubelet writes for a pod whose container cannot start."""
    statuses = [
        {
            "name": c.name,
            "image": c.image,
            "imageID": "",
            "ready": False,
            "restartCount": 0,
            "state": {"waiting": {"reason": reason, "message": message}}
            if c.name == container
            else {"waiting": {"reason": "PodInitializing"}},
        }
        for c in pod.spec.containers
    ]
    return {
        "status": {
            "phase": "Pending",
            "startTime": now,
            "conditions": [
                {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                {
                    "type": "ContainersReady",
                    "status": "False",
                    "reason": "ContainersNotReady",
                    "lastTransitionTime": now,
                },
                {
                    "type": "Ready",
                    "status": "False",
                    "reason": "ContainersNotReady",
                    "lastTransitionTime": now,
                },
            ],
            "containerStatuses": statuses,
        }
    }
