"""kopf handlers (thin) and the one idempotent reconcile they all call: read, decide (pure), act, report."""

from __future__ import annotations

import json
import logging
import threading
from collections import defaultdict

import kopf
from kubernetes import client
from kubernetes.client.rest import ApiException

from spyre_operator import manifests
from spyre_operator.plan import PodPlan, plan_pods
from spyre_operator.settings import (
    CACHE_KEY_LABEL,
    COMPILE_LABEL,
    GROUP,
    HASH_LABEL,
    MODEL_LABEL,
    PLURAL,
    VERSION,
    OperatorSettings,
)
from spyre_operator.spec import InvalidSpec, parse_spec
from spyre_operator.status import compute_status, merge_conditions, observe_job, observe_pod, status_changed

log = logging.getLogger(__name__)


class Reconciler:
    def __init__(self, settings: OperatorSettings, api_client: client.ApiClient) -> None:
        self.settings = settings
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.batch = client.BatchV1Api(api_client)
        self._locks: defaultdict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)

    def reconcile(self, namespace: str, name: str) -> None:
        with self._locks[(namespace, name)]:
            self._reconcile(namespace, name)

    def _reconcile(self, namespace: str, name: str) -> None:
        try:
            model = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as e:
            if e.status == 404:
                return
            raise
        if model["metadata"].get("deletionTimestamp"):
            return
        selector = f"{MODEL_LABEL}={name}"
        try:
            spec = parse_spec(name, model.get("spec") or {})
        except InvalidSpec as e:
            pods = self._list_pods(namespace, selector)
            views = [observe_pod(p, self.settings.card_resource, HASH_LABEL)[0] for p in pods]
            new = compute_status(
                generation=model["metadata"].get("generation", 0),
                replicas=0,
                template_hash="",
                pods=views,
                health=[],
                selector=selector,
                service_address=None,
                card_resource=self.settings.card_resource,
                invalid=str(e),
            )
            if self._write_status(model, new):
                kopf.warn(model, reason="InvalidSpec", message=str(e))
            return

        self._ensure(
            manifests.build_service(model, self.settings),
            self.core.create_namespaced_service,
            self.core.read_namespaced_service,
        )
        claim = manifests.build_cache_claim(model, spec, self.settings)
        if claim is not None:
            self._ensure(
                claim,
                self.core.create_namespaced_persistent_volume_claim,
                self.core.read_namespaced_persistent_volume_claim,
            )

        cache = self._precompile(model, spec) if spec.cache.precompile and not spec.suspend else None

        pod_spec = manifests.pod_template(name, spec, self.settings)
        thash = manifests.template_hash(pod_spec)
        pods = self._list_pods(namespace, selector)
        observed = [observe_pod(p, self.settings.card_resource, HASH_LABEL) for p in pods]
        views = [v for v, _ in observed]
        if cache is not None and not cache.is_ready:
            plan = PodPlan()  # the rollout waits for the cache; the old pods keep serving
        else:
            plan = plan_pods(spec.replicas, thash, views, suspend=spec.suspend)

        for _ in range(plan.create):
            created = self.core.create_namespaced_pod(
                namespace, manifests.build_pod(model, spec, self.settings)
            )
            kopf.info(
                model, reason="PodCreated", message=f"created pod {created.metadata.name} (template {thash})"
            )
        for pod_name in plan.delete:
            try:
                self.core.delete_namespaced_pod(pod_name, namespace)
            except ApiException as e:
                if e.status != 404:
                    raise
            kopf.info(model, reason="PodDeleted", message=f"deleted pod {pod_name}: {plan.reasons[pod_name]}")
        if not plan.is_noop:
            pods = self._list_pods(namespace, selector)
            observed = [observe_pod(p, self.settings.card_resource, HASH_LABEL) for p in pods]

        new = compute_status(
            generation=model["metadata"].get("generation", 0),
            replicas=spec.replicas,
            template_hash=thash,
            pods=[v for v, _ in observed],
            health=[h for _, h in observed],
            selector=selector,
            service_address=f"http://{name}.{namespace}.svc:{self.settings.runtime_port}",
            card_resource=self.settings.card_resource,
            suspended=spec.suspend,
            cache=cache,
        )
        old = model.get("status") or {}
        if self._write_status(model, new):
            was = {c["type"]: c for c in old.get("conditions") or []}.get("Progressing", {})
            now = {c["type"]: c for c in new["conditions"]}["Progressing"]
            if now["reason"] == "RolloutComplete" and was.get("reason") != "RolloutComplete":
                kopf.info(model, reason="RolloutComplete", message=now["message"])
            elif now["reason"] == "WaitingForCards" and was.get("reason") != "WaitingForCards":
                kopf.warn(model, reason="WaitingForCards", message=now["message"])
            degraded = {c["type"]: c for c in new["conditions"]}["Degraded"]
            if degraded["status"] == "True" and was.get("reason") != degraded["reason"]:
                kopf.warn(model, reason=degraded["reason"], message=degraded["message"])

    def _precompile(self, model: dict, spec):
        """Ensures the compile Job of the current cache key; returns what it observed. Once it succeeded,
        compile Jobs of older keys are removed."""
        meta = model["metadata"]
        key = manifests.cache_key(spec, self.settings)
        jobs = self._list(
            self.batch.list_namespaced_job, meta["namespace"], f"{COMPILE_LABEL}={meta['name']}"
        )
        current = next((j for j in jobs if j["metadata"]["labels"].get(CACHE_KEY_LABEL) == key), None)
        if current is None:
            body = manifests.build_compile_job(model, spec, self.settings, key)
            try:
                self.batch.create_namespaced_job(meta["namespace"], body)
            except ApiException as e:
                if e.status != 409:
                    raise
            kopf.info(
                model,
                reason="CompileJobCreated",
                message=f"compile Job {body['metadata']['name']} for cache key {key}",
            )
        state = observe_job(current, key)
        if state.is_ready:
            for job in jobs:
                if job is not current:
                    self._delete_job(job["metadata"]["name"], meta["namespace"])
        return state

    def _delete_job(self, name: str, namespace: str) -> None:
        try:
            self.batch.delete_namespaced_job(name, namespace, propagation_policy="Background")
        except ApiException as e:
            if e.status != 404:
                raise

    def _list(self, lister, namespace: str, selector: str) -> list[dict]:
        resp = lister(namespace, label_selector=selector, _preload_content=False)
        return json.loads(resp.data)["items"]

    def _list_pods(self, namespace: str, selector: str) -> list[dict]:
        return self._list(self.core.list_namespaced_pod, namespace, selector)

    def _ensure(self, obj: dict, create, read) -> None:
        meta = obj["metadata"]
        try:
            read(meta["name"], meta["namespace"], _preload_content=False)
        except ApiException as e:
            if e.status != 404:
                raise
            try:
                create(meta["namespace"], obj)
            except ApiException as e2:
                if e2.status != 409:
                    raise

    def _write_status(self, model: dict, new: dict) -> bool:
        """Writes status only when it changed; returns whether it wrote."""
        old = model.get("status") or {}
        if not status_changed(new, old):
            return False
        merged = merge_conditions(new, old)
        meta = model["metadata"]
        body = {"status": merged}
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], body
        )
        return True


class Resync:
    """Reconciles every SpyreModel in the watched namespaces every `resync_seconds`."""

    def __init__(self, reconciler: Reconciler, settings: OperatorSettings) -> None:
        self.reconciler = reconciler
        self.settings = settings
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="resync", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _models(self) -> list[tuple[str, str]]:
        custom = self.reconciler.custom
        if self.settings.namespaces:
            items = [
                m
                for ns in self.settings.namespaces
                for m in custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]
            ]
        else:
            items = custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)["items"]
        return [(m["metadata"]["namespace"], m["metadata"]["name"]) for m in items]

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.resync_seconds):
            try:
                for namespace, name in self._models():
                    if self._stop.is_set():
                        return
                    self.reconciler.reconcile(namespace, name)
            except Exception:  # the next period retries; one bad pass must not end the resync
                log.exception("resync pass failed")


def build_registry(settings: OperatorSettings) -> kopf.OperatorRegistry:
    """All handlers, registered against a registry of our own (no import-time global state)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**kwargs):
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_):
        # kopf's bookkeeping lives in annotations, never in the (pruned, schema-checked) status
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=GROUP, key="last-handled-configuration"
        )
        settings.posting.level = logging.INFO
        settings.execution.max_workers = 8

    @kopf.on.resume(GROUP, VERSION, PLURAL, id="reconcile", registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, id="reconcile", registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, id="reconcile", registry=registry)
    def model_changed(namespace, name, memo, **_):
        memo.reconciler.reconcile(namespace, name)

    @kopf.on.event("", "v1", "pods", labels={MODEL_LABEL: kopf.PRESENT}, id="pod", registry=registry)
    def pod_event(namespace, labels, memo, **_):
        memo.reconciler.reconcile(namespace, labels[MODEL_LABEL])

    @kopf.on.event("batch", "v1", "jobs", labels={COMPILE_LABEL: kopf.PRESENT}, id="job", registry=registry)
    def job_event(namespace, labels, memo, **_):
        memo.reconciler.reconcile(namespace, labels[COMPILE_LABEL])

    # The periodic resync is a plain thread, not a kopf timer: kopf puts a finalizer on objects with
    # timers, which would block deleting a SpyreModel while the operator is down.
    @kopf.on.startup(registry=registry)
    def start_resync(memo, **_):
        memo.resync = Resync(memo.reconciler, settings)
        memo.resync.start()

    @kopf.on.cleanup(registry=registry)
    def stop_resync(memo, **_):
        memo.resync.stop()

    return registry
