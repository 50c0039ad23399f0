"""Where a SpyreModel's weights come from (spec.model.source, and for downloaded sources spec.model.secretRef
and spec.model.endpoint), parsed once when the spec is read (the URI grammar is spyre_contract.source_uri's)
into one type per scheme. Each scheme says, as KubeAI's model_source.go does, how a pod (a serving replica,
the compile Job) gets the model, always read-only, where the runtime finds it, whether a loader runs and
which Secret keys it reads:

- `pvc://CLAIM/PATH`: the claim, mounted at /models (the model is /models/PATH);
- `file:///PATH`: the node's folder as a hostPath at the same path (an admin turns it on);
- `oci://IMAGE`: the image's `/models` folder at /models, either as an image volume (Kubernetes 1.31+ with the
  ImageVolume feature; `subPath` needs 1.33) or as a modelcar: an init container of the model image copies
  its `/models` into an emptyDir before the runtime starts (any Kubernetes version, any container runtime);
- `hf://`, `s3://`: the model cache, a folder `models/<fetch key>` of the graph-cache claim that the loader
  Job fills (kinds/loader_job.py), mounted read-only at /models; the pods exist only once it is complete."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import ClassVar

from spyre_contract.source_uri import SourceURI

from spyre_operator.settings import CONTAINER_SECURITY, OperatorSettings

MODEL_MOUNT = "/models"  # where a pod finds the model: the claim's root, an image's files, the cache folder
MODEL_IMAGE_FOLDER = "/models"  # where a model image keeps its files (KServe's modelcar convention)
MODELCAR_TARGET = "/mnt/models"  # the emptyDir, as the modelcar's init container sees it
MODELS_FOLDER = "models"  # the model cache's folder in the graph-cache claim
CACHE_VOLUME = "graph-cache"  # the graph-cache claim's volume, in every pod that mounts it

Storage = tuple[list[dict], list[dict], list[dict]]  # (container mounts, pod volumes, init containers)


@dataclass(frozen=True)
class ModelSource:
    """A parsed spec.model.source; a subclass per scheme."""

    parsed: SourceURI
    scheme: ClassVar[str] = ""
    is_downloaded: ClassVar[bool] = False  # the loader Job fills the model cache first
    secret_keys: ClassVar[tuple[tuple[str, bool], ...]] = ()  # what the loader reads: (key, required)

    @property
    def uri(self) -> str:
        return self.parsed.uri

    def __str__(self) -> str:
        return self.parsed.uri

    @property
    def path_in_pod(self) -> str:
        """Where the runtime finds the model."""
        return MODEL_MOUNT

    def refusal(self, settings: OperatorSettings) -> str | None:
        """Why the operator's settings refuse this source; None when they allow it."""
        return None

    def pod_storage(self, settings: OperatorSettings) -> Storage:
        """The runtime container's mounts, the pod's volumes and its init containers that put the model at
        `path_in_pod`, read-only."""
        raise NotImplementedError


@dataclass(frozen=True)
class ClaimSource(ModelSource):
    scheme: ClassVar[str] = "pvc"

    @property
    def path_in_pod(self) -> str:
        return f"{MODEL_MOUNT}/" + self.parsed.path.strip("/")

    def pod_storage(self, settings: OperatorSettings) -> Storage:
        mount = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
        claim = {"claimName": self.parsed.claim, "readOnly": True}
        return [mount], [{"name": "model", "persistentVolumeClaim": claim}], []


@dataclass(frozen=True)
class HostPathSource(ModelSource):
    scheme: ClassVar[str] = "file"

    @property
    def path_in_pod(self) -> str:
        return self.parsed.path

    def refusal(self, settings: OperatorSettings) -> str | None:
        if settings.allow_host_path:
            return None
        return (
            f"{self.uri}: file:// models (a hostPath on the node) are turned off; an admin turns them on "
            "with SPYRE_OPERATOR_ALLOW_HOST_PATH=1 (chart value allowHostPathModels)"
        )

    def pod_storage(self, settings: OperatorSettings) -> Storage:
        path = self.parsed.path
        volume = {"name": "model", "hostPath": {"path": path, "type": "Directory"}}
        return [{"name": "model", "mountPath": path, "readOnly": True}], [volume], []


@dataclass(frozen=True)
class ImageSource(ModelSource):
    scheme: ClassVar[str] = "oci"

    def pod_storage(self, settings: OperatorSettings) -> Storage:
        image = self.parsed.image
        mount = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
        if settings.oci_mode == "image-volume":
            volume = {"name": "model", "image": {"reference": image, "pullPolicy": image_pull_policy(image)}}
            return [{**mount, "subPath": MODEL_IMAGE_FOLDER.strip("/")}], [volume], []
        return [mount], [{"name": "model", "emptyDir": {}}], [modelcar_init(image)]


@dataclass(frozen=True)
class CABundle:
    """spec.model.caBundle: a ConfigMap's key holding PEM certificates (a proxy's, an in-house store's)."""

    config_map: str
    key: str = "ca.crt"


@dataclass(frozen=True)
class DownloadedSource(ModelSource):
    """hf:// and s3://: the loader Job downloads the model into the model cache, which the pods mount."""

    secret_ref: str | None = None  # spec.model.secretRef: the loader's credentials
    endpoint: str | None = None  # spec.model.endpoint: the hub's or object store's URL
    ca_bundle: CABundle | None = None  # spec.model.caBundle: the CA certificates the loader trusts
    is_downloaded: ClassVar[bool] = True

    @property
    def fetch_key(self) -> str:
        """Names one download: the source (with its revision) and the endpoint it is read from."""
        config = {"source": self.uri, "endpoint": self.endpoint}
        return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def cache_folder(self) -> str:
        """The model's folder in the graph-cache claim."""
        return f"{MODELS_FOLDER}/{self.fetch_key}"

    def pod_storage(self, settings: OperatorSettings) -> Storage:
        """The model cache's folder, on the graph-cache volume (which the pod's builder adds)."""
        mount = {
            "name": CACHE_VOLUME,
            "mountPath": MODEL_MOUNT,
            "subPath": self.cache_folder,
            "readOnly": True,
        }
        return [mount], [], []

    def loader_args(self, into: str) -> list[str]:
        """The loader's command line (`spyre-runtime fetch-model ...`)."""
        args = ["fetch-model", "--source", self.uri, "--into", into]
        return args + (["--endpoint", self.endpoint] if self.endpoint else [])


@dataclass(frozen=True)
class HubSource(DownloadedSource):
    scheme: ClassVar[str] = "hf"
    secret_keys: ClassVar[tuple[tuple[str, bool], ...]] = (("HF_TOKEN", True),)


@dataclass(frozen=True)
class ObjectStoreSource(DownloadedSource):
    scheme: ClassVar[str] = "s3"
    secret_keys: ClassVar[tuple[tuple[str, bool], ...]] = (
        ("AWS_ACCESS_KEY_ID", True),
        ("AWS_SECRET_ACCESS_KEY", True),
        ("AWS_SESSION_TOKEN", False),
        ("AWS_REGION", False),
    )


SOURCE_TYPES: dict[str, type[ModelSource]] = {
    t.scheme: t for t in (ClaimSource, HostPathSource, ImageSource, HubSource, ObjectStoreSource)
}


def model_source(parsed: SourceURI, **access) -> ModelSource:
    """The source type of a parsed URI; `access` (secret_ref, endpoint, ca_bundle) only for the downloaded
    schemes."""
    kind = SOURCE_TYPES[parsed.scheme]
    if issubclass(kind, DownloadedSource):
        return kind(parsed, **access)
    if any(v is not None for v in access.values()):
        raise ValueError(f"{parsed.scheme}:// sources take no secretRef, endpoint or caBundle")
    return kind(parsed)


def image_pull_policy(reference: str) -> str:
    """The kubelet's default: Always for :latest or no tag (and no digest), IfNotPresent otherwise."""
    name = reference.split("@", 1)[0]
    tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else ""
    return "Always" if "@" not in reference and tag in ("", "latest") else "IfNotPresent"


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
