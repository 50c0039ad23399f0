"""kopf handlers, thin: each watch event only updates the watch cache and enqueues its model's key; the
work queue's workers run the reconcile (reconcile.Reconciler)."""

from __future__ import annotations

import dataclasses
import logging
import os

import kopf
from kubernetes import client

from spyre_operator.io.metrics import OperatorMetrics
from spyre_operator.io.watch import KnownModels, Resync, WatchCache, plain
from spyre_operator.io.workqueue import WorkQueue
from spyre_operator.kinds.access import NAMESPACE_LABEL
from spyre_operator.reconcile import Reconciler
from spyre_operator.settings import (
    COMPILE_LABEL,
    FETCH_LABEL,
    GROUP,
    MANAGED_BY,
    MODEL_LABEL,
    PLURAL,
    POOL_GROUP,
    POOL_PLURAL,
    POOL_VERSION,
    VERSION,
    OperatorSettings,
)

POOLS = (POOL_GROUP, POOL_VERSION, POOL_PLURAL)


def in_cluster_login(**kwargs) -> kopf.ConnectionInfo | None:
    """The service account's credentials, for the API server at KUBERNETES_SERVICE_HOST:PORT as client-go
    (and this operator's own kubernetes client) dial it; kopf's default, https://kubernetes.default.svc, needs
    cluster DNS, which a host-network pod or a node without it lacks (found on a real node)."""
    info = kopf.login_with_service_account(**kwargs)
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if info is None or not host or not port:
        return info
    host = f"[{host}]" if ":" in host else host
    return dataclasses.replace(info, server=f"https://{host}:{port}")


def login(**kwargs):
    return in_cluster_login(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


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
    # compile and loader Jobs (both carry the managed-by label)
    managed = ",".join(f"{k}={v}" for k, v in MANAGED_BY.items())
    settings.watching.label_selectors["batch", "jobs"] = managed
    settings.watching.label_selectors[POOL_GROUP, POOL_PLURAL] = MODEL_LABEL
    settings.watching.label_selectors["networking.k8s.io", "networkpolicies"] = MODEL_LABEL
    settings.watching.label_selectors["rbac.authorization.k8s.io", "clusterrolebindings"] = MODEL_LABEL
    if memo.settings.pod_monitors:  # said in the start-up log: present or absent
        memo.reconciler.pod_monitor.detect()
    memo.queue.start()
    memo.resync.start()


def build_registry(settings: OperatorSettings) -> kopf.OperatorRegistry:
    """All handlers, registered against a registry of our own (no import-time global state). Each one
    only enqueues its model's key; the work queue's workers reconcile."""
    registry = kopf.OperatorRegistry()

    kopf.on.login(registry=registry)(login)
    kopf.on.startup(registry=registry)(configure)

    # Event handlers, not create/update handlers: no finalizer and no bookkeeping writes on the model;
    # the reconcile decides from what it reads, whatever the event was.
    @kopf.on.event(GROUP, VERSION, PLURAL, id="model", registry=registry)
    async def model_event(type, body, namespace, name, memo, **_):
        key = (namespace, name)
        if type == "DELETED":
            memo.known.discard(key)
            memo.cache.drop_model(key)
            memo.reconciler.forget(key)
            if memo.reconciler.access.has_binding(key):
                memo.queue.add(key)  # its reconcile finds it gone and removes its ClusterRoleBinding
            return
        memo.cache.put_model(key, plain(body))
        memo.known.add(key)
        memo.queue.add(key)

    # The pods' cache is filled by an index: kopf runs no handler before every index has listed its objects,
    # so the first reconcile of any model already sees every pod that existed when the operator started
    # (the pod step acts on the cache, with no list of its own).
    @kopf.index("", "v1", "pods", labels={MODEL_LABEL: kopf.PRESENT}, id="pod_cache", registry=registry)
    async def pod_index(body, namespace, labels, memo, **_):
        memo.cache.put_pod((namespace, labels[MODEL_LABEL]), plain(body))  # kopf's own index stays empty

    @kopf.on.event("", "v1", "pods", labels={MODEL_LABEL: kopf.PRESENT}, id="pod", registry=registry)
    async def pod_event(type, namespace, name, labels, memo, **_):
        key = (namespace, labels[MODEL_LABEL])
        if type == "DELETED":
            memo.cache.drop_pod(key, name)
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

    # watched from the moment its CRD is installed (kopf follows CRDs): a cluster without it is no error. The
    # cache knows which models have a pool, so a model that wants none is never asked about one it has not.
    @kopf.on.event(*POOLS, labels={MODEL_LABEL: kopf.PRESENT}, id="pool", registry=registry)
    async def pool_event(type, namespace, labels, memo, **_):
        key = (namespace, labels[MODEL_LABEL])
        if type == "DELETED":
            memo.cache.pool_gone(key)
        else:
            memo.cache.pool_reported(key)
            if not memo.cache.pool_seen(key) and type != "MODIFIED":
                return  # known already, and listed at start-up (checked anyway) or just created
        memo.cache.owned_changed(key)  # new to the cache, drifted or deleted: check it again
        memo.queue.add(key)

    _watch_network_policies(registry)
    register_access_handlers(registry)

    @kopf.on.event("batch", "v1", "jobs", id="job", registry=registry)
    async def job_event(namespace, labels, memo, **_):
        if model := labels.get(COMPILE_LABEL) or labels.get(FETCH_LABEL):  # a compile or loader Job
            memo.queue.add((namespace, model))

    @kopf.on.cleanup(registry=registry)
    def stop(memo, **_):
        memo.resync.stop()
        memo.queue.stop()

    return registry


def _watch_network_policies(registry: kopf.OperatorRegistry) -> None:
    """The models' NetworkPolicies (kinds/network_policy.py), listed at start-up too: a model's policy left
    from when the setting was on is known, and removed."""

    @kopf.on.event(
        "networking.k8s.io",
        "v1",
        "networkpolicies",
        labels={MODEL_LABEL: kopf.PRESENT},
        id="netpol",
        registry=registry,
    )
    async def policy_event(type, namespace, labels, memo, **_):
        key = (namespace, labels[MODEL_LABEL])
        memo.cache.policy_seen(key, type != "DELETED")
        if type in (None, "ADDED") and memo.settings.network_policy:
            return  # listed at start-up (checked anyway) or just created
        memo.cache.owned_changed(key)  # drifted, deleted, or left over: check it again
        memo.queue.add(key)


def register_access_handlers(registry: kopf.OperatorRegistry) -> None:
    """Who may call a model (kinds/access.py): the Secrets its pods read, token authorization's bindings."""

    # the Secrets models' pods read (spec.auth.apiKey, spec.tls): new data rolls the pods, a Secret that
    # appears lets them start. Users' Secrets carry no label of ours: every Secret's events arrive, and only
    # those of a Secret a model reads enqueue anything (their data is never kept).
    @kopf.on.event("", "v1", "secrets", id="secret", registry=registry)
    async def secret_event(namespace, name, memo, **_):
        for key in memo.reconciler.access.secret_changed(namespace, name):
            memo.queue.add(key)

    # token authorization's ClusterRoleBindings (cluster-scoped, so no owner reference): a binding whose
    # model is gone is removed by that model's reconcile, also when the model went while the operator was down
    @kopf.on.event(
        "rbac.authorization.k8s.io",
        "v1",
        "clusterrolebindings",
        labels={MODEL_LABEL: kopf.PRESENT, NAMESPACE_LABEL: kopf.PRESENT},
        id="binding",
        registry=registry,
    )
    async def binding_event(type, labels, memo, **_):
        key = (labels[NAMESPACE_LABEL], labels[MODEL_LABEL])
        if type != "DELETED" and memo.reconciler.access.binding_seen(key):
            memo.queue.add(key)


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
