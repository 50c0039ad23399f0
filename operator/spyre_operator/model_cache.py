"""The model cache of a downloaded model (hf://, s3://): the loader's ServiceAccount, Role and RoleBinding
(made once per model), then one loader Job per fetch key that fills `models/<key>` of the graph-cache claim.
The pods and the compile Job wait until it succeeded; while it runs the model is looked at again every few
seconds for the loader's progress; once it succeeded, the Jobs of older keys are removed. A failed Job (its
retries spent, or the loader's permanent exit code) stays until a human deletes it: the model is Stalled
with the loader's last words."""

from __future__ import annotations

from kubernetes.client.rest import ApiException

from spyre_operator import loader_job
from spyre_operator.events import EventRecorder
from spyre_operator.kube import Kube, problem_of
from spyre_operator.model_spec import ModelSpec
from spyre_operator.model_volumes import fetch_key
from spyre_operator.observe import ModelCacheState, observe_loader
from spyre_operator.settings import CACHE_KEY_LABEL, FETCH_LABEL, PROGRESS_ANNOTATION, OperatorSettings
from spyre_operator.work import Pass

PROGRESS_SECONDS = 2.0  # how often a download's progress is read into the status
# what holds the pods of a downloaded model whose loader Job could not be read this pass
UNREAD = ModelCacheState("", False, False, "Downloading", "the loader Job could not be read")


class ModelCacheStep:
    def __init__(self, settings: OperatorSettings, kube: Kube, events: EventRecorder) -> None:
        self.settings = settings
        self.kube = kube
        self.events = events
        self._has_access: set[tuple[str, str]] = set()  # (namespace, model uid): the loader's RBAC is made

    def ensure(self, model: dict, spec: ModelSpec, work: Pass) -> ModelCacheState | None:
        """The current fetch key's loader Job as observed (after creating it); None for a model that is not
        downloaded, or when the objects could not be read or written (then a problem in `work`)."""
        if not spec.model_source.is_downloaded:
            return None
        meta = model["metadata"]
        ns, key = meta["namespace"], fetch_key(spec)
        try:
            self._ensure_access(model)
        except ApiException as e:
            work.problems.append(problem_of("LoaderAccess", e))  # its ServiceAccount, Role, RoleBinding
            return None
        try:
            jobs = self.kube.list("Job", ns, f"{FETCH_LABEL}={meta['name']}")
            current = next((j for j in jobs if j["metadata"]["labels"].get(CACHE_KEY_LABEL) == key), None)
            if current is None:
                self._create(model, spec, key)
                return observe_loader(None, [], key, PROGRESS_ANNOTATION)
            pods = self.kube.list("Pod", ns, f"{FETCH_LABEL}={meta['name']},{CACHE_KEY_LABEL}={key}")
            state = observe_loader(current, pods, key, PROGRESS_ANNOTATION)
            if state.is_ready:
                for job in jobs:
                    if job is not current:
                        self.kube.delete("Job", job["metadata"]["name"], ns)
            elif state.is_failed:
                self.events.post(model, "Warning", "DownloadFailed", state.message)
            else:
                work.later(PROGRESS_SECONDS)
            return state
        except ApiException as e:
            work.problems.append(problem_of("Job", e))
            return None

    def forget(self, key: tuple[str, str]) -> None:
        self._has_access = {a for a in self._has_access if a[0] != key[0]}

    def _ensure_access(self, model: dict) -> None:
        stamp = (model["metadata"]["namespace"], model["metadata"]["uid"])
        if stamp in self._has_access:
            return
        for body in loader_job.build_loader_access(model):
            self.kube.create_unless_exists(body)
        self._has_access.add(stamp)

    def _create(self, model: dict, spec: ModelSpec, key: str) -> None:
        body = loader_job.build_loader_job(model, spec, self.settings, key)
        if not self.kube.create_unless_exists(body):
            return  # the previous Job of this key is still being removed; the next pass looks again
        self.events.post(
            model,
            "Normal",
            "LoaderJobCreated",
            f"loader Job {body['metadata']['name']} downloads {spec.source} into the model cache (key {key})",
        )
