"""The model's status and Events, written once per pass: the status is a pure function of what the pass
observed (status.compute_status), replaced as a whole and only when it changed; Events mark its transitions
(rollout complete, waiting for cards, a new Degraded reason). A failure the reconcile could not handle still
reaches the status (`failure`)."""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.error
import urllib.request
from collections import Counter

from kubernetes.client.rest import ApiException

from spyre_operator.io.events import EventRecorder
from spyre_operator.io.kube import Kube
from spyre_operator.io.metrics import OperatorMetrics
from spyre_operator.io.work import Pass, Problem
from spyre_operator.kinds.compile_job import CacheState
from spyre_operator.kinds.inference_pool import PoolState
from spyre_operator.kinds.loader_job import ModelCacheState
from spyre_operator.kinds.pods.observe import PodHealth, observe_pods
from spyre_operator.kinds.pods.plan import PodView
from spyre_operator.settings import GROUP, KIND, MODEL_LABEL, VERSION, OperatorSettings
from spyre_operator.spec import placement
from spyre_operator.spec.model_spec import InvalidSpec, ModelSpec
from spyre_operator.status.conditions import compute_status, merge_conditions, status_changed


class Conflict(Exception):
    """The model changed under us (409 on the status write): reconcile again from a fresh read."""


class Reporter:
    def __init__(
        self, settings: OperatorSettings, kube: Kube, events: EventRecorder, metrics: OperatorMetrics
    ) -> None:
        self.settings = settings
        self.kube = kube
        self.events = events
        self.metrics = metrics

    def progress(
        self,
        model: dict,
        spec: ModelSpec,
        thash: str,
        pods: list[dict],
        cache: CacheState | None,
        work: Pass,
        pool: PoolState | None = None,
        model_cache: ModelCacheState | None = None,
    ) -> None:
        """The status of an admitted model, after its steps acted."""
        for problem in work.problems:
            self.metrics.api_errors.labels(problem.reason, "").inc()
        status = self._status(model, pods, spec, thash, cache, work, pool=pool, model_cache=model_cache)
        self._write(model, status)

    def invalid(self, model: dict, error: InvalidSpec, pods: list[dict]) -> None:
        """The status of a model whose spec was refused: Stalled, nothing rolled out."""
        # a name that is no label value cannot select pods (and none can carry it)
        pods = [] if error.field_path == "metadata.name" else pods
        self._write(model, self._status(model, pods, invalid=error))

    def failure(self, model: dict, problem: Problem) -> None:
        """The old status with Ready False, Reconciling and Degraded True, naming the problem."""
        old = model.get("status") or {}
        new = {
            **{k: v for k, v in old.items() if k != "conditions"},
            "observedGeneration": model["metadata"].get("generation", 0),
        }
        conditions = {c["type"]: dict(c) for c in old.get("conditions") or []}
        for type_, status in (("Ready", "False"), ("Reconciling", "True"), ("Degraded", "True")):
            conditions[type_] = {
                "type": type_,
                "status": status,
                "reason": problem.reason,
                "message": problem.message,
                "observedGeneration": new["observedGeneration"],
            }
        new["conditions"] = list(conditions.values())
        self._write(model, new)

    def _status(
        self,
        model: dict,
        pods: list[dict],
        spec: ModelSpec | None = None,
        thash: str = "",
        cache: CacheState | None = None,
        work: Pass | None = None,
        invalid: InvalidSpec | None = None,
        pool: PoolState | None = None,
        model_cache: ModelCacheState | None = None,
    ) -> dict:
        meta = model["metadata"]
        work = work or Pass()
        card_resource = (
            placement.card_resource_for(spec, self.settings) if spec else self.settings.card_resource
        )
        observed = observe_pods(pods, self.settings, card_resource)
        status = compute_status(
            generation=meta.get("generation", 0),
            replicas=spec.replicas if spec else 0,
            template_hash=thash,
            pods=[v for v, _ in observed],
            health=[h for _, h in observed],
            selector=f"{MODEL_LABEL}={meta['name']}",
            service_address=(
                f"{'https' if spec.tls else 'http'}://{meta['name']}.{meta['namespace']}.svc:"
                f"{self.settings.runtime_port}"
                if spec
                else None
            ),
            card_resource=card_resource,
            start_grace_seconds=self.settings.start_grace_seconds,
            invalid=str(invalid) if invalid else None,
            invalid_reason=invalid.reason if invalid else "InvalidSpec",
            suspended=bool(spec and spec.suspend),
            cache=cache,
            model_cache=model_cache,
            problems=tuple(work.problems),
            waiting=work.waiting,
            waiting_reason=work.waiting_reason,
            warming=(
                warmup_progress(pods, observed, self.settings.runtime_port, bool(spec.tls)) if spec else {}
            ),
            inference_pool=pool,
        )
        pod_states, job_state = _states(observed, cache)
        self.metrics.observe_model((meta["namespace"], meta["name"]), status["phase"], pod_states, job_state)
        return status

    def _write(self, model: dict, new: dict) -> bool:
        """Replaces the status (stale keys vanish) when it changed; posts Events on transitions."""
        old = model.get("status") or {}
        if not status_changed(new, old):
            return False
        merged = merge_conditions(new, old)
        meta = model["metadata"]
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "metadata": {
                "name": meta["name"],
                "namespace": meta["namespace"],
                "resourceVersion": meta["resourceVersion"],
            },
            "spec": model.get("spec") or {},
            "status": merged,
        }
        try:
            self.kube.replace_model_status(body)
        except ApiException as e:
            if e.status == 409:
                raise Conflict() from None
            if e.status == 404:  # deleted meanwhile: nothing to report on
                return False
            raise
        self._post_transitions(model, old, merged)
        return True

    def _post_transitions(self, model: dict, old: dict, new: dict) -> None:
        before = {c["type"]: c for c in old.get("conditions") or []}
        after = {c["type"]: c for c in new.get("conditions") or []}
        progressing, was = after.get("Progressing", {}), before.get("Progressing", {})
        if progressing.get("reason") != was.get("reason"):
            if progressing.get("reason") == "RolloutComplete":
                self.events.post(model, "Normal", "RolloutComplete", progressing["message"], once=False)
            elif progressing.get("reason") in (
                "WaitingForCards",
                "WaitingForCapacity",
                "WaitingForClaim",
                "NotStarted",
                "Unschedulable",
            ):
                self.events.post(model, "Warning", progressing["reason"], progressing["message"])
            elif progressing.get("reason") == "StagedRollout":
                self.events.post(model, "Normal", "StagedRollout", progressing["message"])
        degraded, was = after.get("Degraded", {}), before.get("Degraded", {})
        if degraded.get("status") == "True" and (degraded.get("reason"), degraded.get("message")) != (
            was.get("reason"),
            was.get("message"),
        ):
            self.events.post(model, "Warning", degraded["reason"], degraded["message"])


# what reading a pod's /health can raise: no answer, a stalled or cut-off body, not HTTP, not JSON
_UNREADABLE = (OSError, http.client.HTTPException, ValueError)


def warmup_progress(
    pods: list[dict], observed: list[tuple[PodView, PodHealth]], runtime_port: int, is_https: bool = False
) -> dict[str, tuple[int, int]]:
    """Graphs warmed so far by pods that run but are not Ready yet, from their /health (the runtime
    answers 503 {"warming": {"done", "total"}}): a person watching the model sees `compiling 7/12`.
    At most 4 pods, half a second each; a pod that does not answer is left out. Over HTTPS for a model
    with spec.tls, its certificate unchecked: only a progress count is read, nothing is sent."""
    context = ssl._create_unverified_context() if is_https else None
    progress: dict[str, tuple[int, int]] = {}
    by_name = {p["metadata"]["name"]: p for p in pods}
    for view, _ in observed:
        if view.is_ready or view.is_dead or view.is_terminating or len(progress) >= 4:
            continue
        status = by_name[view.name].get("status") or {}
        if status.get("phase") != "Running" or not status.get("podIP"):
            continue
        url = f"{'https' if is_https else 'http'}://{status['podIP']}:{runtime_port}/health"
        try:
            urllib.request.urlopen(url, timeout=0.5, context=context).close()  # 200: warm by now
        except urllib.error.HTTPError as e:
            try:  # its body can stall, be cut off or be anything at all: the count is only a courtesy
                warming = json.loads(e.read() or b"{}").get("warming") or {}
                progress[view.name] = (int(warming["done"]), int(warming["total"]))
            except (*_UNREADABLE, KeyError, TypeError, AttributeError):
                pass
        except _UNREADABLE:
            pass
    return progress


def _states(
    observed: list[tuple[PodView, PodHealth]], cache: CacheState | None
) -> tuple[Counter, str | None]:
    """For the metrics: the pods by state, and the compile Job's state."""
    pods = Counter(
        "terminating" if v.is_terminating else "dead" if v.is_dead else "ready" if v.is_ready else "starting"
        for v, _ in observed
    )
    job = (
        None
        if cache is None
        else "succeeded"
        if cache.is_ready
        else "failed"
        if cache.is_failed
        else "running"
    )
    return pods, job
