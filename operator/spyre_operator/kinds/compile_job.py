"""The compile Job of a precompiled model: one per cache key (what the graphs depend on), filling the shared
claim before serving pods start; a failed attempt is retried with back-off up to the settings' attempts,
and once the current key's Job succeeded, the Jobs of older keys are removed. Its builder, and what is read
off it (a CacheState), are here too."""

from __future__ import annotations

import datetime
import hashlib
import json
from dataclasses import dataclass

from kubernetes.client.rest import ApiException
from spyre_contract.memory import resolved_dtype

from spyre_operator.io.events import EventRecorder
from spyre_operator.io.kube import Kube, problem_of
from spyre_operator.io.work import Pass
from spyre_operator.kinds.ownership import owner_reference
from spyre_operator.kinds.pods.template import placement_fields, pod_storage
from spyre_operator.settings import (
    ATTEMPT_ANNOTATION,
    CACHE_KEY_LABEL,
    COMPILE_LABEL,
    COMPONENT_LABEL,
    CONTAINER_SECURITY,
    MANAGED_BY,
    OperatorSettings,
    pod_security,
)
from spyre_operator.spec.model_spec import ModelSpec
from spyre_operator.spec.runtime_contract import engine_args, runtime_env


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
        key = cache_key(spec, self.settings)
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
        body = build_compile_job(model, spec, self.settings, key, attempt)
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


# ---- the builder -------------------------------------------------------------------------------


def cache_key(spec: ModelSpec, settings: OperatorSettings) -> str:
    """Names one compile configuration: what the graphs depend on as far as the operator can see (the
    model source, backend, shapes or limits, cards, the model's and the KV cache's dtypes, runtime image and
    user environment). The runtime keys its entries finer still (weights digest, library versions)."""
    config = {
        "source": spec.source.uri,
        "backend": spec.backend,
        "mode": spec.mode,
        "shapes": [[s.prompt_length, s.new_tokens, s.batch_size] for s in spec.shapes]
        if spec.mode == "static"
        else None,
        "engine": engine_args(spec),
        "image": spec.image or settings.runtime_image,
        "env": list(spec.env),
    }
    # each left out when it is what auto runs (float16 on Spyre; the KV cache: the model's dtype): the
    # graphs are the same, and the keys of caches compiled before the field existed stay the same
    if spec.dtype not in ("auto", resolved_dtype(spec.backend, "auto", None)):
        config["dtype"] = spec.dtype
    if spec.kv_cache_dtype not in ("auto", resolved_dtype(spec.backend, spec.dtype, None)):
        config["kv_cache_dtype"] = spec.kv_cache_dtype
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def compile_job_name(name: str, key: str) -> str:
    return f"{name[:40]}-compile-{key[:10]}"


def build_compile_job(
    model: dict, spec: ModelSpec, settings: OperatorSettings, key: str, attempt: int = 1
) -> dict:
    """A Job that runs `spyre-runtime compile` into the shared cache. It requests no cards: inductor
    compiles on CPU and sendnn uses its card-less compile-only backend."""
    name = model["metadata"]["name"]
    mounts, volumes, init = pod_storage(name, spec, settings, is_serving=False)
    resources = {k: dict(v) for k, v in spec.resources.items() if k in ("requests", "limits")}
    labels = {COMPILE_LABEL: name, CACHE_KEY_LABEL: key, COMPONENT_LABEL: "compile", **MANAGED_BY}
    container = {
        "name": "compile",
        "image": spec.image or settings.runtime_image,
        "command": ["spyre-runtime"],
        "args": ["compile", spec.source.path_in_pod, *engine_args(spec)],
        "env": runtime_env(spec, serving=False),
        "resources": resources,
        "volumeMounts": mounts,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": dict(CONTAINER_SECURITY),
    }
    pod_spec = {
        **({"initContainers": init} if init else {}),
        "containers": [container],
        "volumes": volumes,
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security(settings),
    }
    placement_fields(pod_spec, spec, settings)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": compile_job_name(name, key),
            "namespace": model["metadata"]["namespace"],
            "labels": labels,
            "annotations": {ATTEMPT_ANNOTATION: str(attempt)},
            "ownerReferences": [owner_reference(model)],
        },
        "spec": {
            "backoffLimit": 1,
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


# ---- what is read off it ------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheState:
    """The compile Job of the current cache key, as observed."""

    key: str
    is_ready: bool
    is_failed: bool
    reason: str
    message: str
    attempt: int = 1
    max_attempts: int = 1
    failed_at: str = ""  # when the current attempt failed

    @property
    def can_retry(self) -> bool:
        return self.is_failed and self.attempt < self.max_attempts


def observe_job(
    job: dict | None, key: str, max_attempts: int = 1, attempt_annotation: str = ""
) -> CacheState:
    """Reads a compile Job's status (None: not created yet)."""
    if job is None:
        return CacheState(key, False, False, "Compiling", f"creating the compile Job for cache key {key}")
    status = job.get("status") or {}
    name = job["metadata"]["name"]
    try:
        attempt = int((job["metadata"].get("annotations") or {}).get(attempt_annotation, 1))
    except ValueError:
        attempt = 1
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    failed = conditions.get("Failed", {})
    if status.get("succeeded"):
        return CacheState(key, True, False, "Compiled", f"compile Job {name} filled the cache for key {key}")
    if failed.get("status") == "True":
        reason = failed.get("reason") or "JobFailed"
        detail = failed.get("message") or "the compile Job failed"
        tail = (
            f"attempt {attempt} of {max_attempts}, retrying with back-off"
            if attempt < max_attempts
            else f"failed {attempt} of {max_attempts} attempts: fix the cause, then delete the Job to retry"
        )
        return CacheState(
            key,
            False,
            True,
            "CompileJobFailed",
            f"compile Job {name} failed ({reason}): {detail} ({tail})",
            attempt,
            max_attempts,
            failed.get("lastTransitionTime") or "",
        )
    return CacheState(
        key,
        False,
        False,
        "Compiling",
        f"compile Job {name} is filling the cache for key {key}"
        + (f" (attempt {attempt} of {max_attempts})" if attempt > 1 else ""),
        attempt,
        max_attempts,
    )
