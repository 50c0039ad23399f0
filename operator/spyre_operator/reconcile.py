"""The one idempotent reconcile the work queue runs per model key, read as a table of contents:

1. observe: the watch's cached view of the model and its pods (io/watch.py);
2. admit the spec (admission.py; spec/ parses it, its source into one type per scheme);
3. one step per owned kind, each in its own file under kinds/ holding its decide-and-ensure step and its
   builder, acting through io/kube.py: the Service (service.py), the graph-cache claim
   (graph_cache_claim.py), the InferencePool (inference_pool.py), the PodMonitor (pod_monitor.py), the
   NetworkPolicy (network_policy.py),
   the loader Job that fills the model cache (loader_job.py), the compile Job (compile_job.py), the
   ResourceClaimTemplate of DRA cards (resource_claim_template.py), who may call the model (access.py:
   the Secrets its pods read, digested into their template, and token authorization's identity) and the
   pods (pods/: acting on the watch's view, no list of its own);
4. the status and its Events, written once (status/).

Whatever fails while acting ends in the model's status (a condition naming the object and the API server's
message) and one Event per distinct error, and the key is retried with back-off; nothing raises into kopf."""

from __future__ import annotations

import logging
import time

from kubernetes import client
from kubernetes.client.rest import ApiException

from spyre_operator.admission import Admission
from spyre_operator.io.events import EventRecorder
from spyre_operator.io.kube import Kube, api_message, problem_of
from spyre_operator.io.metrics import OperatorMetrics
from spyre_operator.io.watch import Key, WatchCache
from spyre_operator.io.work import Pass, Problem
from spyre_operator.io.workqueue import Result
from spyre_operator.kinds.access import AccessStep
from spyre_operator.kinds.compile_job import CompileJobStep
from spyre_operator.kinds.graph_cache_claim import GraphCacheClaimStep
from spyre_operator.kinds.inference_pool import InferencePoolStep, PoolState
from spyre_operator.kinds.loader_job import UNREAD, LoaderJobStep
from spyre_operator.kinds.network_policy import NetworkPolicyStep
from spyre_operator.kinds.pod_monitor import PodMonitorStep
from spyre_operator.kinds.pods.step import PodStep
from spyre_operator.kinds.pods.template import pod_template, template_hash
from spyre_operator.kinds.resource_claim_template import ResourceClaimTemplateStep
from spyre_operator.kinds.service import ServiceStep
from spyre_operator.settings import OperatorSettings
from spyre_operator.spec.model_spec import InvalidSpec, ModelSpec
from spyre_operator.status.report import Conflict, Reporter

log = logging.getLogger(__name__)


class Reconciler:
    def __init__(
        self,
        settings: OperatorSettings,
        api_client: client.ApiClient,
        metrics: OperatorMetrics | None = None,
        cache: WatchCache | None = None,
    ) -> None:
        self.settings = settings
        self.cache = cache or WatchCache()
        self.metrics = metrics or OperatorMetrics()
        self.kube = Kube(api_client, settings.api_timeout_seconds)
        events = EventRecorder(self.kube.core, settings.api_timeout_seconds)
        self.admission = Admission(settings, self.kube)
        self.service = ServiceStep(settings, self.kube, events)
        self.graph_cache_claim = GraphCacheClaimStep(settings, self.kube, events)
        self.resource_claim_template = ResourceClaimTemplateStep(settings, self.kube, events)
        self.inference_pool = InferencePoolStep(settings, self.kube, events)
        self.pod_monitor = PodMonitorStep(settings, self.kube, events)
        self.network_policy = NetworkPolicyStep(settings, self.kube, events, self.cache)
        self.loader_job = LoaderJobStep(settings, self.kube, events)
        self.compile_job = CompileJobStep(settings, self.kube, events)
        self.access = AccessStep(settings, self.kube)
        self.pods = PodStep(settings, self.kube, events, self.cache)
        self.report = Reporter(settings, self.kube, events, self.metrics)

    def reconcile(self, key: Key) -> Result:
        started = time.monotonic()
        result = self._guarded(key)
        self.metrics.reconcile_seconds.observe(time.monotonic() - started)
        outcome = "error" if result.failed else "requeue" if result.after is not None else "success"
        self.metrics.reconciles.labels(outcome).inc()
        return result

    def _reconcile(self, key: Key, model: dict) -> Result:
        """Admit the spec; the Service, the claims, the InferencePool and the NetworkPolicy; the model
        cache's loader Job; the compile Job; the pods; the status and Events. The compile Job and the pods
        wait for the model."""
        try:
            spec = self.admission.admit(key, model)
        except InvalidSpec as e:
            self.report.invalid(model, e, self.cache.pods(key))
            return Result()
        work = Pass()
        has_claim = self._ensure_service_and_claim(key, model, spec, work)
        pool = self._ensure_inference_pool(key, model, spec, work)
        self._ensure_once(key, model, "PodMonitor", lambda: self.pod_monitor.ensure(model, work))
        self.network_policy.ensure(key, model, spec, work)
        downloads = spec.source.is_downloaded and not spec.suspend
        model_cache = self.loader_job.ensure(model, spec, work) if downloads and has_claim else None
        has_model = not downloads or (model_cache is not None and model_cache.is_ready)
        cache = None
        if spec.cache.precompile and not spec.suspend and has_claim and has_model:
            cache = self.compile_job.ensure(model, spec, work)
        pods = self.cache.pods(key)
        has_claim = has_claim and self.resource_claim_template.ensure(model, spec, pods, work)
        secured = self.access.ensure(model, spec, work)  # the Secrets' digest, or None: the pods wait
        spec = secured or spec
        thash = template_hash(pod_template(key[1], spec, self.settings), spec.secret_digest)
        if has_claim and secured is not None:
            # the new template waits for its model (also when its loader Job was unread), then its graphs
            gate = cache if has_model else (model_cache or UNREAD)
            pods, acted = self.pods.ensure(key, model, spec, thash, pods, gate, work)
            if acted and not work.problems:
                # the watch reports the pods just made or removed, and that pass writes the status
                return Result(after=work.after)
        elif secured is not None:
            work.waiting_reason = "WaitingForClaim"
            work.waiting = "the pods wait for their claims (graph cache, cards)"
        self.report.progress(model, spec, thash, pods, cache, work, pool, model_cache)
        return Result(failed=True) if work.problems else Result(after=work.after)

    def _ensure_service_and_claim(self, key: Key, model: dict, spec: ModelSpec, work: Pass) -> bool:
        """Checked once per generation and again when their watch reports a change. Pods do not depend on
        their Service (they are made even when it fails), only on their claim: True when it is there."""
        stamp = (model["metadata"]["uid"], model["metadata"].get("generation"))
        if self.cache.owned_stamp(key, "service-and-claim") == stamp:
            return True
        has_service = self.service.ensure(model, work, spec.tls)
        has_claim = self.graph_cache_claim.ensure(model, spec, work)
        if has_service and has_claim and not work.problems:
            self.cache.set_owned_stamp(key, "service-and-claim", stamp)
        return has_claim

    def _ensure_once(self, key: Key, model: dict, what: str, ensure) -> None:
        """An owned object checked once per model generation (again when `ensure` says it is not settled)."""
        stamp = (model["metadata"]["uid"], model["metadata"].get("generation"))
        if self.cache.owned_stamp(key, what) != stamp and ensure():
            self.cache.set_owned_stamp(key, what, stamp)

    def _ensure_inference_pool(self, key: Key, model: dict, spec: ModelSpec, work: Pass) -> PoolState | None:
        """Checked once per generation and again when its watch reports a change; while the cluster does not
        serve the InferencePool API, at every pass (asking the API server once per resync period). A model
        that wants none is asked about only when the watch has seen a pool of its. Pods do not depend on it.
        A pool is taken as checked only once its watch has reported it: kopf starts that watch when the CRD
        appears, and in `make test` it once did not after the CRD had gone and come back, so a drift went
        unrepaired; until the watch reports the pool, every pass (each resync) checks it again with one read.
        The pool's state for the status; None when the model wants none."""
        stamp = (model["metadata"]["uid"], model["metadata"].get("generation"))
        is_checked = self.cache.owned_stamp(key, "InferencePool") == stamp
        settled = not is_checked and self.inference_pool.ensure(
            key, model, spec, work, self.cache.has_pool(key)
        )
        if settled and (self.inference_pool.state(key) is None or self.cache.is_pool_reported(key)):
            self.cache.set_owned_stamp(key, "InferencePool", stamp)
        state = self.inference_pool.state(key)
        if state is not None and state.is_ready:
            self.cache.pool_seen(key)  # made or found: its watch event is no news
        return state

    def _guarded(self, key: Key) -> Result:
        """The model (from the watch, else asked once), reconciled unless it is being deleted; a failure
        that escapes the steps still reaches its status."""
        namespace, name = key
        model = self.cache.model(key)
        if model is None:  # not seen by the watch (yet): ask once
            try:
                model = self.kube.get_model(namespace, name)
            except ApiException as e:
                if e.status == 404:
                    self.forget(key)
                    self.access.release(key)  # its ClusterRoleBinding, which no owner reference removes
                    return Result()
                log.warning("reading SpyreModel %s/%s: %s", namespace, name, api_message(e))
                return Result(failed=True)
        if model["metadata"].get("deletionTimestamp"):
            return Result()
        try:
            return self._reconcile(key, model)
        except Conflict:
            return Result(after=0.5)
        except Exception as e:  # a bug or an unexpected failure: it still reaches the status
            log.exception("reconcile of %s/%s failed", namespace, name)
            problem = problem_of("Reconcile", e) if isinstance(e, ApiException) else None
            problem = problem or Problem("ReconcileError", f"{type(e).__name__}: {e}", is_stalled=False)
            try:
                self.report.failure(model, problem)
            except Exception:
                log.exception("could not report the failure of %s/%s", namespace, name)
            return Result(failed=True)

    def forget(self, key: Key) -> None:
        self.metrics.forget(key)
        self.admission.forget(key)
        self.pods.forget(key)
        self.inference_pool.forget(key)
        self.loader_job.forget(key)
        self.access.forget(key)
