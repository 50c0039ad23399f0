"""kopf handlers (thin: they only enqueue the model's key) and the one idempotent reconcile the work queue
runs per key: read, validate, decide (pure), act, report. Whatever fails while acting ends in the model's
status (a condition naming the object and the API server's message) and one Event per distinct error, and
the key is retried with back-off; nothing raises into kopf."""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import kopf
from kubernetes import client
from kubernetes.client.rest import ApiException

from spyre_operator import manifests
from spyre_operator.events import EventRecorder
from spyre_operator.metrics import OperatorMetrics
from spyre_operator.model_spec import ModelSpec, quantity_bytes
from spyre_operator.observe import CacheState, observe_job, observe_pod
from spyre_operator.plan import Budget, PodPlan, plan_pods
from spyre_operator.runtime_contract import check_fit
from spyre_operator.settings import (
    ATTEMPT_ANNOTATION,
    CACHE_KEY_LABEL,
    COMPILE_LABEL,
    GROUP,
    HASH_LABEL,
    KIND,
    MANAGED_BY,
    MODEL_LABEL,
    PLURAL,
    SPEC_LABEL,
    VERSION,
    OperatorSettings,
)
from spyre_operator.spec import InvalidSpec, parse_spec
from spyre_operator.status import Problem, compute_status, merge_conditions, status_changed
from spyre_operator.watch import KnownModels, Resync, WatchCache, plain
from spyre_operator.workqueue import Result, WorkQueue

log = logging.getLogger(__name__)

Key = tuple[str, str]


def api_message(e: ApiException) -> str:
    """The API server's own message (its Status body), else the HTTP reason."""
    try:
        body = json.loads(e.body or "")
        if isinstance(body, dict) and body.get("message"):
            return str(body["message"])
    except (TypeError, ValueError):
        pass
    return f"{e.status} {e.reason}".strip()


def is_quota(e: ApiException) -> bool:
    return e.status == 403 and "exceeded quota" in api_message(e)


def problem_of(kind: str, e: Exception) -> Problem:
    """A failed action on an object of `kind`: refused (4xx, needs a human: Stalled) or failed (5xx,
    timeouts: retried)."""
    if isinstance(e, ApiException):
        if is_quota(e):
            return Problem("QuotaExceeded", f"{kind} refused: {api_message(e)}", is_stalled=False)
        if e.status and 400 <= e.status < 500 and e.status not in (408, 409, 429):
            return Problem(f"{kind}Rejected", api_message(e))
        return Problem("APIError", f"{kind}: {api_message(e)}", is_stalled=False)
    return Problem("APIError", f"{kind}: {type(e).__name__}: {e}", is_stalled=False)


class Conflict(Exception):
    """The model changed under us (409 on the status write): reconcile again from a fresh read."""


@dataclass
class Pass:
    """What one reconcile pass gathered while acting."""

    problems: list[Problem] = field(default_factory=list)
    waiting: str = ""
    waiting_reason: str = "WaitingForCapacity"
    after: float | None = None  # run again in this many seconds

    def later(self, seconds: float) -> None:
        self.after = seconds if self.after is None else min(self.after, seconds)


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
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.batch = client.BatchV1Api(api_client)
        self.timeout = settings.api_timeout_seconds
        self.events = EventRecorder(self.core, self.timeout)
        self._validated: dict[Key, tuple] = {}  # key -> (uid, generation, template hash) dry-run passed
        self._quota_blocked: set[Key] = set()
        self._rolling: set[Key] = set()  # models rolling out a change of the operator's settings
        self._lock = threading.Lock()

    # ---- the pass -----------------------------------------------------------------------------------

    def reconcile(self, key: Key) -> Result:
        started = time.monotonic()
        result = self._pass(key)
        self.metrics.reconcile_seconds.observe(time.monotonic() - started)
        outcome = "error" if result.failed else "requeue" if result.after is not None else "success"
        self.metrics.reconciles.labels(outcome).inc()
        return result

    def _pass(self, key: Key) -> Result:
        namespace, name = key
        model = self.cache.model(key)
        if model is None:  # not seen by the watch (yet): ask once
            try:
                model = self.custom.get_namespaced_custom_object(
                    GROUP, VERSION, namespace, PLURAL, name, _request_timeout=self.timeout
                )
            except ApiException as e:
                if e.status == 404:
                    self.forget(key)
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
                self._report_failure(model, problem)
            except Exception:
                log.exception("could not report the failure of %s/%s", namespace, name)
            return Result(failed=True)

    def _reconcile(self, key: Key, model: dict) -> Result:
        namespace, name = key
        selector = f"{MODEL_LABEL}={name}"
        try:
            spec = parse_spec(name, model.get("spec") or {})
            check_fit(spec, self.settings)
            self._dry_run(key, model, spec)
        except InvalidSpec as e:
            # a name that is no label value cannot select pods (and none can carry it)
            pods = [] if e.field_path == "metadata.name" else None
            self._write(
                model, self._status(model, selector, pods=pods, invalid=str(e), invalid_reason=e.reason)
            )
            return Result()

        work = Pass()
        stamp = (model["metadata"]["uid"], model["metadata"].get("generation"))
        claim_ok = True
        if self.cache.owned_stamp(key) != stamp:
            # the Service and the claim, checked once per generation and again when their watch reports a
            # change; pods do not depend on their Service: they are made even when it fails
            service_ok = self._ensure_service(model, work)
            claim_ok = self._ensure_claim(model, spec, work)
            if service_ok and claim_ok and not work.problems:
                self.cache.set_owned_stamp(key, stamp)
        cache = None
        if spec.cache.precompile and not spec.suspend and claim_ok:
            cache = self._precompile(model, spec, work)

        pod_spec = manifests.pod_template(name, spec, self.settings)
        thash = manifests.template_hash(pod_spec)
        pods = self.cache.pods(key)
        acted = False
        if claim_ok:
            plan, build = self._decide(key, model, spec, thash, pods, cache, work)
            if not plan.is_noop:
                # decided on the watch's view; act only on a fresh one (the watch may lag our own writes)
                pods = self._list(self.core.list_namespaced_pod, namespace, selector)
                plan, build = self._decide(key, model, spec, thash, pods, cache, work)
                acted = not plan.is_noop
                self._apply(key, model, plan, build, work)
        else:
            work.waiting = "the pods wait for their graph-cache claim"
        if acted and not work.problems:
            # the watch reports the pods just made or removed, and that pass writes the status
            return Result(after=work.after)

        for problem in work.problems:
            self.metrics.api_errors.labels(problem.reason, "").inc()
        new = self._status(
            model,
            selector,
            spec=spec,
            thash=thash,
            pods=pods,
            cache=cache,
            problems=tuple(work.problems),
            waiting=work.waiting,
            waiting_reason=work.waiting_reason,
        )
        self._write(model, new)
        if work.problems:
            return Result(failed=True)
        return Result(after=work.after)

    # ---- validation --------------------------------------------------------------------------------

    def _dry_run(self, key: Key, model: dict, spec: ModelSpec) -> None:
        """Asks the API server (dryRun=All: admission and validation, nothing stored) whether it would
        accept every object of this spec; a refusal is an InvalidSpec. Done once per generation."""
        meta = model["metadata"]
        pod = manifests.build_pod(model, spec, self.settings)
        # a fixed name, so the API server's message (and the condition) is the same at every pass
        pod["metadata"]["name"] = pod["metadata"].pop("generateName").rstrip("-")
        stamp = (meta["uid"], meta.get("generation"), pod["metadata"]["labels"][HASH_LABEL])
        seen = self._validated.get(key)
        if seen is not None and seen[0] == stamp:
            if seen[1]:
                raise InvalidSpec("", seen[1])
            return
        ns = meta["namespace"]
        # the Service and the claim are built from fields checked above; their creation reports the rest
        attempts = [("Pod", self.core.create_namespaced_pod, pod)]
        if spec.cache.precompile:
            job = manifests.build_compile_job(
                model, spec, self.settings, manifests.cache_key(spec, self.settings)
            )
            attempts.append(("Job", self.batch.create_namespaced_job, job))
        for kind, create, body in attempts:
            try:
                create(ns, body, dry_run="All", _request_timeout=self.timeout, _preload_content=False)
            except ApiException as e:
                if e.status in (408, 409, 429) or is_quota(e) or (e.status or 500) >= 500:
                    continue  # exists already, quota (a rollout matter), or the server's trouble
                refusal = f"the API server refuses the {kind}: {api_message(e)}"
                self._validated[key] = (stamp, refusal)
                raise InvalidSpec("", refusal) from None
        self._validated[key] = (stamp, "")

    # ---- owned objects -----------------------------------------------------------------------------

    def _owned_by(self, obj: dict, model: dict) -> bool:
        uid = model["metadata"]["uid"]
        return any(r.get("uid") == uid for r in obj["metadata"].get("ownerReferences") or [])

    def _created(self, create, body: dict) -> bool:
        """Creates `body`; False when an object of its name exists already (then it is read and checked)."""
        try:
            create(body["metadata"]["namespace"], body, _request_timeout=self.timeout, _preload_content=False)
        except ApiException as e:
            if e.status == 409:
                return False
            raise
        return True

    def _read(self, read, name: str, namespace: str) -> dict | None:
        try:
            resp = read(name, namespace, _preload_content=False, _request_timeout=self.timeout)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return json.loads(resp.data)

    def _ensure_service(self, model: dict, work: Pass) -> bool:
        want = manifests.build_service(model, self.settings)
        meta = want["metadata"]
        try:
            if self._created(self.core.create_namespaced_service, want):
                return True
            have = self._read(self.core.read_namespaced_service, meta["name"], meta["namespace"])
            if have is None:  # removed meanwhile: the next pass makes it
                raise ApiException(status=409, reason="Service was being removed")
            if not self._owned_by(have, model):
                work.problems.append(
                    Problem(
                        "ServiceConflict",
                        f"Service {meta['name']} exists and is not owned by this SpyreModel: rename the model"
                        " or remove the Service",
                    )
                )
                return False
            ports = [
                {k: p.get(k) for k in ("name", "port", "targetPort", "protocol")}
                for p in have["spec"].get("ports") or []
            ]
            if have["spec"].get("selector") != want["spec"]["selector"] or ports != want["spec"]["ports"]:
                patch = {"spec": {"selector": want["spec"]["selector"], "ports": want["spec"]["ports"]}}
                self.core.patch_namespaced_service(
                    meta["name"], meta["namespace"], patch, _request_timeout=self.timeout
                )
                self.events.post(
                    model, "Normal", "ServiceRepaired", f"Service {meta['name']}: selector and ports restored"
                )
            return True
        except ApiException as e:
            work.problems.append(problem_of("Service", e))
            return False

    def _ensure_claim(self, model: dict, spec: ModelSpec, work: Pass) -> bool:
        want = manifests.build_cache_claim(model, spec, self.settings)
        if want is None:
            return True
        meta = want["metadata"]
        name, ns = meta["name"], meta["namespace"]
        try:
            if self._created(self.core.create_namespaced_persistent_volume_claim, want):
                return True
            have = self._read(self.core.read_namespaced_persistent_volume_claim, name, ns)
            if have is None:
                raise ApiException(status=409, reason="claim was being removed")
            labels = have["metadata"].get("labels") or {}
            owners = have["metadata"].get("ownerReferences") or []
            ours = labels.get(MODEL_LABEL) == model["metadata"]["name"] and all(
                labels.get(k) == v for k, v in MANAGED_BY.items()
            )
            if not ours or (owners and not self._owned_by(have, model)):
                work.problems.append(
                    Problem(
                        "ClaimConflict",
                        f"PersistentVolumeClaim {name} exists and belongs to another object: set "
                        "graphCache.existingClaim to use it, or remove it",
                    )
                )
                return False
            patch: dict = {}
            have_size = have["spec"]["resources"]["requests"]["storage"]
            if quantity_bytes(spec.cache.size) > quantity_bytes(have_size):
                patch["spec"] = {"resources": {"requests": {"storage": spec.cache.size}}}
            want_owned = spec.cache.retention == "Delete"
            if want_owned != bool(owners):
                patch["metadata"] = {"ownerReferences": meta.get("ownerReferences", [])}
            if patch:
                self.core.patch_namespaced_persistent_volume_claim(
                    name, ns, patch, _request_timeout=self.timeout
                )
                self.events.post(model, "Normal", "ClaimUpdated", f"claim {name}: {sorted(patch)} updated")
            want_class = want["spec"].get("storageClassName")
            mismatch = []
            if want_class and have["spec"].get("storageClassName") != want_class:
                mismatch.append(f"storage class {have['spec'].get('storageClassName')} (spec: {want_class})")
            if have["spec"].get("accessModes") != want["spec"]["accessModes"]:
                mismatch.append(
                    f"access modes {have['spec'].get('accessModes')} (spec: {want['spec']['accessModes']})"
                )
            if quantity_bytes(spec.cache.size) < quantity_bytes(have_size):
                mismatch.append(f"size {have_size} (spec: {spec.cache.size}; claims do not shrink)")
            if mismatch:
                work.problems.append(
                    Problem(
                        "ClaimNeedsReplacement",
                        f"claim {name} has {', '.join(mismatch)}: delete the claim to have it recreated",
                    )
                )
            return True
        except ApiException as e:
            work.problems.append(problem_of("PersistentVolumeClaim", e))
            return False

    # ---- compile Job -------------------------------------------------------------------------------

    def _precompile(self, model: dict, spec: ModelSpec, work: Pass) -> CacheState | None:
        """Ensures the compile Job of the current cache key (retried with back-off up to the settings'
        attempts); returns what it observed. Once it succeeded, compile Jobs of older keys are removed."""
        meta = model["metadata"]
        ns = meta["namespace"]
        key = manifests.cache_key(spec, self.settings)
        attempts = self.settings.compile_attempts
        try:
            jobs = self._list(self.batch.list_namespaced_job, ns, f"{COMPILE_LABEL}={meta['name']}")
            current = next((j for j in jobs if j["metadata"]["labels"].get(CACHE_KEY_LABEL) == key), None)
            state = observe_job(current, key, attempts, ATTEMPT_ANNOTATION)
            if current is None:
                self._create_job(model, spec, key, 1)
            elif state.can_retry:
                delay = self.settings.compile_retry_seconds * 2 ** (state.attempt - 1)
                waited = _seconds_since(state.failed_at)
                if waited >= delay:
                    self._delete_job(current["metadata"]["name"], ns)
                    self._create_job(model, spec, key, state.attempt + 1)
                    state = observe_job(None, key)
                else:
                    work.later(delay - waited)
            if state.is_ready:
                for job in jobs:
                    if job is not current:
                        self._delete_job(job["metadata"]["name"], ns)
            return state
        except ApiException as e:
            work.problems.append(problem_of("Job", e))
            return None

    def _create_job(self, model: dict, spec: ModelSpec, key: str, attempt: int) -> None:
        body = manifests.build_compile_job(model, spec, self.settings, key, attempt)
        try:
            self.batch.create_namespaced_job(
                model["metadata"]["namespace"], body, _request_timeout=self.timeout
            )
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

    def _delete_job(self, name: str, namespace: str) -> None:
        try:
            self.batch.delete_namespaced_job(
                name, namespace, propagation_policy="Background", _request_timeout=self.timeout
            )
        except ApiException as e:
            if e.status != 404:
                raise

    # ---- pods --------------------------------------------------------------------------------------

    def _decide(
        self,
        key: Key,
        model: dict,
        spec: ModelSpec,
        thash: str,
        pods: list[dict],
        cache: CacheState | None,
        work: Pass,
    ) -> tuple[PodPlan, object]:
        """The pod plan for what `pods` shows, and how to build a new pod."""
        observed = [self._observe(p) for p in pods]
        views = [v for v, _ in observed]
        by_name = {p["metadata"]["name"]: p for p in pods}
        hold = cache is not None and not cache.is_ready  # the new template waits for its cache
        if not hold and self._waits_for_a_slot(key, model, spec, thash, pods):
            hold = True
            work.waiting_reason = "StagedRollout"
            work.waiting = (
                "the operator's own settings changed the pods: at most "
                f"{self.settings.max_concurrent_rollouts} models roll out at a time; this one keeps serving "
                "its pods until its turn"
            )
        if hold:
            # the pods of the serving template are kept whole meanwhile
            serving = _serving_hash(views)
            if serving is None:
                return PodPlan(), None
            plan = plan_pods(spec.replicas, serving, views, suspend=spec.suspend)
            template = next(p for p in pods if p["metadata"]["labels"].get(HASH_LABEL) == serving)
            build = lambda: manifests.clone_pod(template)  # noqa: E731
        else:
            surge, unavailable = spec.rollout.resolve(spec.replicas)
            can_host = None
            starving = key in self._quota_blocked or any(
                v.lacks_cards and v.template_hash == thash for v in views
            )
            if starving:
                can_host = self._can_host(spec, views, by_name)
            plan = plan_pods(
                spec.replicas,
                thash,
                views,
                suspend=spec.suspend,
                budget=Budget(surge, unavailable),
                can_host=can_host,
                quota_blocked=key in self._quota_blocked,
            )
            build = lambda: manifests.build_pod(model, spec, self.settings)  # noqa: E731
        work.waiting = plan.waiting or work.waiting
        # stuck pods are replaced after their grace period: look again then
        for view, health in observed:
            if health.failure_reason and not view.is_dead and not view.is_terminating:
                work.later(self.settings.stuck_grace_seconds / 2)
        return plan, build

    def _waits_for_a_slot(self, key: Key, model: dict, spec: ModelSpec, thash: str, pods: list[dict]) -> bool:
        """A change of the operator's own settings (runtime image, card resource, ...) rolls out across
        models at most `max_concurrent_rollouts` at a time; a change of the model's spec always rolls."""
        live = [
            p
            for p in pods
            if not p["metadata"].get("deletionTimestamp")
            and (p.get("status") or {}).get("phase") not in ("Failed", "Succeeded")
        ]
        labels = [p["metadata"].get("labels") or {} for p in live]
        with self._lock:
            if not live and key in self._rolling and not spec.suspend and spec.replicas > 0:
                return False  # between deleting its old pods and creating new ones: keeps its slot
            all_new = all(lb.get(HASH_LABEL) == thash for lb in labels)
            if not live or (all_new and (key not in self._rolling or all(map(_pod_ready, live)))):
                # nothing serving yet, or rolled out: a model rolling in a slot keeps it until every pod is
                # new and Ready (when the old pods went first, for want of cards, the new one still starts)
                self._rolling.discard(key)
                return False
            if key in self._rolling or any(lb.get(HASH_LABEL) == thash for lb in labels):
                self._rolling.add(key)  # under way: finish it
                return False
            if any(lb.get(SPEC_LABEL) != manifests.spec_hash(model) for lb in labels):
                return False  # the user changed the spec
            if len(self._rolling) < self.settings.max_concurrent_rollouts:
                self._rolling.add(key)
                return False
            return True

    def _apply(self, key: Key, model: dict, plan: PodPlan, build, work: Pass) -> None:
        ns = model["metadata"]["namespace"]
        for pod_name in plan.delete:
            try:
                self.core.delete_namespaced_pod(
                    pod_name, ns, _request_timeout=self.timeout, _preload_content=False
                )
            except ApiException as e:
                if e.status != 404:
                    work.problems.append(problem_of("Pod", e))
                    continue
            reason = plan.reasons[pod_name]
            kind = "Warning" if reason.startswith(("pod ended", "stuck")) else "Normal"
            event = "PodReplaced" if kind == "Warning" else "PodDeleted"
            self.events.post(model, kind, event, f"deleted pod {pod_name}: {reason}", once=False)
        with self._lock:
            self._quota_blocked.discard(key)
        for _ in range(plan.create):
            try:
                resp = self.core.create_namespaced_pod(
                    ns, build(), _request_timeout=self.timeout, _preload_content=False
                )
            except ApiException as e:
                if is_quota(e):
                    with self._lock:
                        self._quota_blocked.add(key)
                work.problems.append(problem_of("Pod", e))
                break
            self.events.post(
                model,
                "Normal",
                "PodCreated",
                f"created pod {json.loads(resp.data)['metadata']['name']}",
                once=False,
            )

    def _observe(self, pod: dict):
        return observe_pod(
            pod,
            self.settings.card_resource,
            HASH_LABEL,
            stuck_grace_seconds=self.settings.stuck_grace_seconds,
        )

    def _can_host(self, spec: ModelSpec, views, by_name: dict) -> frozenset[str] | None:
        """Old pods whose node could host a pod of the current template once they leave: the node
        matches the spec's nodeSelector and has the cards (its allocatable cards, less what other pods
        there hold, plus the leaving pod's). None when nodes cannot be read (namespaced RBAC)."""
        res = self.settings.card_resource
        hosts = set()
        try:
            for view in views:
                if view.template_hash == "" or not view.node or view.is_terminating:
                    continue
                node = self.core.read_node(view.node, _preload_content=False, _request_timeout=self.timeout)
                node = json.loads(node.data)
                labels = node["metadata"].get("labels") or {}
                if any(labels.get(k) != v for k, v in spec.node_selector.items()):
                    continue
                allocatable = _cards(node["status"].get("allocatable", {}).get(res))
                used = 0
                resp = self.core.list_pod_for_all_namespaces(
                    field_selector=f"spec.nodeName={view.node}",
                    _preload_content=False,
                    _request_timeout=self.timeout,
                )
                for other in json.loads(resp.data)["items"]:
                    if (other.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                        continue
                    for c in other["spec"]["containers"]:
                        used += _cards(((c.get("resources") or {}).get("requests") or {}).get(res))
                leaving = sum(
                    _cards(((c.get("resources") or {}).get("requests") or {}).get(res))
                    for c in by_name[view.name]["spec"]["containers"]
                )
                if allocatable - used + leaving >= spec.cards:
                    hosts.add(view.name)
        except ApiException as e:
            if e.status in (401, 403):
                return None
            raise
        return frozenset(hosts)

    # ---- status ------------------------------------------------------------------------------------

    def _status(
        self,
        model: dict,
        selector: str,
        spec: ModelSpec | None = None,
        thash: str = "",
        pods: list[dict] | None = None,
        cache: CacheState | None = None,
        problems: tuple[Problem, ...] = (),
        waiting: str = "",
        invalid: str | None = None,
        waiting_reason: str = "WaitingForCapacity",
        invalid_reason: str = "InvalidSpec",
    ) -> dict:
        meta = model["metadata"]
        if pods is None:
            pods = self.cache.pods((meta["namespace"], meta["name"]))
        observed = [self._observe(p) for p in pods]
        warming = self._warmup_progress(pods, observed) if spec and not invalid else {}
        status = compute_status(
            generation=meta.get("generation", 0),
            replicas=spec.replicas if spec else 0,
            template_hash=thash,
            pods=[v for v, _ in observed],
            health=[h for _, h in observed],
            selector=selector,
            service_address=(
                f"http://{meta['name']}.{meta['namespace']}.svc:{self.settings.runtime_port}"
                if spec
                else None
            ),
            card_resource=self.settings.card_resource,
            invalid=invalid,
            invalid_reason=invalid_reason,
            suspended=bool(spec and spec.suspend),
            cache=cache,
            problems=problems,
            waiting=waiting,
            waiting_reason=waiting_reason,
            warming=warming,
        )
        states = Counter(
            "terminating"
            if v.is_terminating
            else "dead"
            if v.is_dead
            else "ready"
            if v.is_ready
            else "starting"
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
        self.metrics.observe_model((meta["namespace"], meta["name"]), status["phase"], states, job)
        return status

    def _warmup_progress(self, pods: list[dict], observed) -> dict[str, tuple[int, int]]:
        """Graphs warmed so far by pods that run but are not Ready yet, from their /health (the runtime
        answers 503 {"warming": {"done", "total"}}): a person watching the model sees `compiling 7/12`.
        At most 4 pods, half a second each; a pod that does not answer is left out."""
        progress: dict[str, tuple[int, int]] = {}
        by_name = {p["metadata"]["name"]: p for p in pods}
        for view, _ in observed:
            if view.is_ready or view.is_dead or view.is_terminating or len(progress) >= 4:
                continue
            status = by_name[view.name].get("status") or {}
            if status.get("phase") != "Running" or not status.get("podIP"):
                continue
            url = f"http://{status['podIP']}:{self.settings.runtime_port}/health"
            try:
                urllib.request.urlopen(url, timeout=0.5).close()  # 200: warm by now
            except urllib.error.HTTPError as e:
                try:
                    warming = json.loads(e.read() or b"{}").get("warming") or {}
                    progress[view.name] = (int(warming["done"]), int(warming["total"]))
                except (ValueError, KeyError, TypeError, AttributeError):
                    pass
            except (OSError, ValueError):
                pass
        return progress

    def _report_failure(self, model: dict, problem: Problem) -> None:
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
            self.custom.replace_namespaced_custom_object_status(
                GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], body, _request_timeout=self.timeout
            )
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
            elif progressing.get("reason") in ("WaitingForCards", "WaitingForCapacity"):
                self.events.post(model, "Warning", progressing["reason"], progressing["message"])
            elif progressing.get("reason") == "StagedRollout":
                self.events.post(model, "Normal", "StagedRollout", progressing["message"])
        degraded, was = after.get("Degraded", {}), before.get("Degraded", {})
        if degraded.get("status") == "True" and (degraded.get("reason"), degraded.get("message")) != (
            was.get("reason"),
            was.get("message"),
        ):
            self.events.post(model, "Warning", degraded["reason"], degraded["message"])

    # ---- helpers -----------------------------------------------------------------------------------

    def _list(self, lister, namespace: str, selector: str) -> list[dict]:
        resp = lister(
            namespace, label_selector=selector, _preload_content=False, _request_timeout=self.timeout
        )
        return json.loads(resp.data)["items"]

    def forget(self, key: Key) -> None:
        self.metrics.forget(key)
        self._validated.pop(key, None)
        with self._lock:
            self._quota_blocked.discard(key)
            self._rolling.discard(key)


def _pod_ready(pod: dict) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _serving_hash(views) -> str | None:
    """The template most live pods run (ready ones first): the rollout that serves now."""
    live = [v for v in views if not v.is_terminating and not v.is_dead]
    if not live:
        return None
    counts = Counter((v.is_ready, v.template_hash) for v in live)
    return max(counts, key=lambda k: (counts[k] if k[0] else 0, counts[k]))[1]


def _cards(value) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def _seconds_since(stamp: str) -> float:
    try:
        then = datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    except ValueError:
        return float("inf")
    return (datetime.datetime.now(datetime.UTC) - then).total_seconds()


def build_registry(settings: OperatorSettings) -> kopf.OperatorRegistry:
    """All handlers, registered against a registry of our own (no import-time global state). Each one
    only enqueues its model's key; the work queue's workers reconcile."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**kwargs):
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, memo, **_):
        # kopf's bookkeeping lives in annotations, never in the (pruned, schema-checked) status
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=GROUP, key="last-handled-configuration"
        )
        settings.posting.level = logging.INFO
        # a line per handled watch event costs more than the handler (which only enqueues) at fleet scale
        if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
            logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        # server-side filtering: the operator never streams the cluster's other pods and Jobs
        settings.watching.label_selectors["pods"] = MODEL_LABEL
        settings.watching.label_selectors["services"] = MODEL_LABEL
        settings.watching.label_selectors["persistentvolumeclaims"] = MODEL_LABEL
        settings.watching.label_selectors["batch", "jobs"] = COMPILE_LABEL
        memo.queue.start()
        memo.resync.start()

    # Event handlers, not create/update handlers: no finalizer and no bookkeeping writes on the model;
    # the reconcile decides from what it reads, whatever the event was.
    @kopf.on.event(GROUP, VERSION, PLURAL, id="model", registry=registry)
    async def model_event(type, body, namespace, name, memo, **_):
        key = (namespace, name)
        if type == "DELETED":
            memo.known.discard(key)
            memo.cache.drop_model(key)
            memo.reconciler.forget(key)
            return
        memo.cache.put_model(key, plain(body))
        memo.known.add(key)
        memo.queue.add(key)

    @kopf.on.event("", "v1", "pods", labels={MODEL_LABEL: kopf.PRESENT}, id="pod", registry=registry)
    async def pod_event(type, body, namespace, name, labels, memo, **_):
        key = (namespace, labels[MODEL_LABEL])
        if type == "DELETED":
            memo.cache.drop_pod(key, name)
        else:
            memo.cache.put_pod(key, plain(body))
        memo.queue.add(key)

    @kopf.on.event("", "v1", "services", labels={MODEL_LABEL: kopf.PRESENT}, id="service", registry=registry)
    @kopf.on.event(
        "", "v1", "persistentvolumeclaims", labels={MODEL_LABEL: kopf.PRESENT}, id="claim", registry=registry
    )
    async def owned_event(type, namespace, labels, memo, **_):
        if type not in ("MODIFIED", "DELETED"):
            return  # listed at start-up (checked anyway) or just created (by us, or after a deletion)
        key = (namespace, labels[MODEL_LABEL])
        memo.cache.owned_changed(key)  # drifted or deleted by someone: check it again
        memo.queue.add(key)

    @kopf.on.event("batch", "v1", "jobs", labels={COMPILE_LABEL: kopf.PRESENT}, id="job", registry=registry)
    async def job_event(namespace, labels, memo, **_):
        memo.queue.add((namespace, labels[COMPILE_LABEL]))

    @kopf.on.cleanup(registry=registry)
    def stop(memo, **_):
        memo.resync.stop()
        memo.queue.stop()

    return registry


def build_memo(
    settings: OperatorSettings, api_client: client.ApiClient, metrics: OperatorMetrics | None = None
) -> kopf.Memo:
    cache = WatchCache()
    reconciler = Reconciler(settings, api_client, metrics, cache)
    queue = WorkQueue(reconciler.reconcile, workers=settings.workers)
    reconciler.metrics.queue_depth = queue.depth
    known = KnownModels()
    return kopf.Memo(
        cache=cache,
        reconciler=reconciler,
        queue=queue,
        known=known,
        resync=Resync(queue, known, settings),
        settings=settings,
    )
