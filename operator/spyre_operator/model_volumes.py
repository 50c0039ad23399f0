"""How a pod (a serving replica, the compile Job) gets its model, per source scheme: pure builders of the
volumes, the runtime container's mounts and the init containers. The model is always read-only:

- `pvc://CLAIM/PATH`: the claim, mounted at /models (the model is /models/PATH);
- `file:///PATH`: the node's folder as a hostPath at the same path (an admin turns it on);
- `oci://IMAGE`: the image's `/models` folder at /models, either as an image volume (Kubernetes 1.31+ with the
  ImageVolume feature; `subPath` needs 1.33) or as a modelcar: an init container of the model image copies
  its `/models` into an emptyDir before the runtime starts (any Kubernetes version, any container runtime);
- `hf://`, `s3://`: the model cache, a folder `models/<fetch key>` of the graph-cache claim that the loader
  Job fills (loader_job.py), mounted read-only at /models; the pods exist only once it is complete."""

from __future__ import annotations

import hashlib
import json

from spyre_operator.model_spec import MODEL_MOUNT, ModelSpec
from spyre_operator.settings import OperatorSettings

MODEL_IMAGE_FOLDER = "/models"  # where a model image keeps its files (KServe's modelcar convention)
MODELCAR_TARGET = "/mnt/models"  # the emptyDir, as the modelcar's init container sees it
MODELS_FOLDER = "models"  # the model cache's folder in the graph-cache claim
CACHE_VOLUME = "graph-cache"

CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "readOnlyRootFilesystem": True,  # the runtime writes only to /tmp, /dev/shm and the cache volume
}


def fetch_key(spec: ModelSpec) -> str:
    """Names one download: the source (with its revision) and the endpoint it is read from."""
    config = {"source": spec.source, "endpoint": spec.endpoint}
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def cache_folder(spec: ModelSpec) -> str:
    """The model's folder in the graph-cache claim (hf://, s3://)."""
    return f"{MODELS_FOLDER}/{fetch_key(spec)}"


def image_pull_policy(reference: str) -> str:
    """The kubelet's default: Always for :latest or no tag (and no digest), IfNotPresent otherwise."""
    name = reference.split("@", 1)[0]
    tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else ""
    return "Always" if "@" not in reference and tag in ("", "latest") else "IfNotPresent"


def model_storage(spec: ModelSpec, settings: OperatorSettings) -> tuple[list[dict], list[dict], list[dict]]:
    """(the runtime container's mounts, the pod's volumes, the pod's init containers) that put the model at
    `spec.model_path_in_pod`, read-only. The model cache's mount uses the graph-cache volume, which the
    caller adds."""
    source = spec.model_source
    if source.scheme == "pvc":
        mount = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
        return (
            [mount],
            [{"name": "model", "persistentVolumeClaim": {"claimName": source.claim, "readOnly": True}}],
            [],
        )
    if source.scheme == "file":
        volume = {"name": "model", "hostPath": {"path": source.path, "type": "Directory"}}
        return [{"name": "model", "mountPath": source.path, "readOnly": True}], [volume], []
    if source.is_downloaded:
        mount = {
            "name": CACHE_VOLUME,
            "mountPath": MODEL_MOUNT,
            "subPath": cache_folder(spec),
            "readOnly": True,
        }
        return [mount], [], []
    mount = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
    if settings.oci_mode == "image-volume":
        volume = {
            "name": "model",
            "image": {"reference": source.image, "pullPolicy": image_pull_policy(source.image)},
        }
        return [{**mount, "subPath": MODEL_IMAGE_FOLDER.strip("/")}], [volume], []
    return [mount], [{"name": "model", "emptyDir": {}}], [modelcar_init(source.image)]


def modelcar_init(reference: str) -> dict:
    """The modelcar: the model image itself, run once before the runtime, copies its files into the pod's
    emptyDir (its image needs `cp`, as KServe's modelcar images have a shell). The runtime never sees a
    half-copied folder: it starts only after this container succeeded."""
    return {
        "name": "model",
        "image": reference,
        "imagePullPolicy": image_pull_policy(reference),
        "command": ["cp", "-R", f"{MODEL_IMAGE_FOLDER}/.", f"{MODELCAR_TARGET}/"],
        "volumeMounts": [{"name": "model", "mountPath": MODELCAR_TARGET}],
        "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}},
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": dict(CONTAINER_SECURITY),
    }


def dropped_image_volumes(sent: dict, stored: dict) -> list[str]:
    """The image volumes of a pod (or a Job's pod template) that the API server did not keep: one that does
    not serve them (before 1.31, or the ImageVolume feature gate off) drops the field and defaults the volume
    to an empty emptyDir, so the pod would start without its model."""

    def volumes(obj: dict) -> dict[str, dict]:
        pod_spec = obj.get("spec") or {}
        pod_spec = (pod_spec.get("template") or {}).get("spec") or pod_spec
        return {v.get("name"): v for v in pod_spec.get("volumes") or []}

    kept = volumes(stored or {})
    return [name for name, v in volumes(sent).items() if "image" in v and "image" not in kept.get(name, {})]
