"""The compile Job of a precompiled model: one per cache key (what the graphs depend on), filling the shared
claim before serving pods start; a failed attempt is retried with back-off up to the settings' attempts,
and once the current key's Job succeeded, the Jobs of older keys are removed."""

from __future__ import annotations

import datetime

from kubernetes.client.rest import ApiException

from spyre_operator import manifests
from spyre_operator.events import EventRecorder
from spyre_operator.kube import Kube, problem_of
from spyre_operator.model_spec import ModelSpec
from spyre_operator.observe import CacheState, observe_job
from spyre_operator.settings import ATTEMPT_ANNOTATION, CACHE_KEY_LABEL, COMPILE_LABEL, OperatorSettings
from spyre_operator.work import Pass


class CompileJobStep:
    def __init__(self, settings: OperatorSettings, kube: Kube, events: EventRecorder) -> None:
        self.settings = settings
        self.kube = kube
        self.events = events

    def ensure(self, model: dict, spec: ModelSpec, work: Pass) -> CacheState | None:
        """The current cache key's Job as observed (after creating or retrying it); None when the Jobs
        could not be read or written (then a problem in `work`)."""
        meta = model["metadata"]
        ns = meta["namespace"]
        key = manifests.cache_key(spec, self.settings)
        try:
            jobs = self.kube.list("Job", ns, f"{COMPILE_LABEL}={meta['name']}")
            current = next((j for j in jobs if j["metadata"]["labels"].get(CACHE_KEY_LABEL) == key), None)
            state = observe_job(current, key, self.settings.compile_attempts, ATTEMPT_ANNOTATION)
            if current is None:
                self._create(model, spec, key, 1)
            elif state.can_retry:
                delay = self.settings.compile_retry_seconds * 2 ** (state.attempt - 1)
                waited = _seconds_since(state.failed_at)
                if waited >= delay:
                    self.kube.delete("Job", current["metadata"]["name"], ns)
                    self._create(model, spec, key, state.attempt + 1)
                    state = observe_job(None, key)
                else:
                    work.later(delay - waited)
            if state.is_ready:
                for job in jobs:
                    if job is not current:
                        self.kube.delete("Job", job["metadata"]["name"], ns)
            return state
        except ApiException as e:
            work.problems.append(problem_of("Job", e))
            return None

    def _create(self, model: dict, spec: ModelSpec, key: str, attempt: int) -> None:
        body = manifests.build_compile_job(model, spec, self.settings, key, attempt)
        try:
            self.kube.create(body)
        except ApiException as e:
            if e.status != 409:  # 409: the previous attempt is still being removed; the next pass retries
                raise
            return
        self.events.post(
            model,
            "Normal",
            "CompileJobCreated",
            f"compile Job {body['metadata']['name']} for cache key {key} (attempt {attempt})",
        )


def _seconds_since(stamp: str) -> float:
    try:
        then = datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    except ValueError:
        return float("inf")
    return (datetime.datetime.now(datetime.UTC) - then).total_seconds()
