"""The model's pods: decide (`plan_pods`, pure, on the watch's view), then delete and create pods as the plan
says, posting an Event for each. The plan is fed what the rollout may do now: the template to roll out (or
the serving one, held while the graph cache fills or while the model waits for a rollout slot), the rollout
budget, and which old pods' nodes could host a new pod when cards are short.

The watch's view is acted on as it is (no list of the model's pods beside the watch) once it shows the
operator's own last writes, and as read then (a view read before may lack them); until then the step waits
for the watch's events, which bring the model back.
The pods are listed from the API server only when the cache cannot answer: a write of ours the watch has not
shown within watch.EXPECT_SECONDS (its event lost, or a pod that came and went within one batch of events).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from kubernetes.client.rest import ApiException

from spyre_operator.io.events import EventRecorder
from spyre_operator.io.kube import Kube, is_quota, problem_of
from spyre_operator.io.watch import Key, WatchCache
from spyre_operator.io.work import Pass
from spyre_operator.kinds.pods.observe import observe_pods
from spyre_operator.kinds.pods.plan import Budget, PodPlan, PodView, plan_pods
from spyre_operator.kinds.pods.template import build_pod, clone_pod, spec_hash
from spyre_operator.settings import HASH_LABEL, MODEL_LABEL, SPEC_LABEL, OperatorSettings
from spyre_operator.spec import placement
from spyre_operator.spec.model_spec import ModelSpec

log = logging.getLogger(__name__)


class Gate(Protocol):
    """What the new template waits for (its model in the model cache, its graphs in the graph cache): the
    loader Job's or the compile Job's state."""

    @property
    def is_ready(self) -> bool: ...


class PodStep:
    def __init__(
        self, settings: OperatorSettings, kube: Kube, events: EventRecorder, watch: WatchCache
    ) -> None:
        self.settings = settings
        self.kube = kube
        self.events = events
        self.watch = watch
        self.slots = RolloutSlots(settings.max_concurrent_rollouts)
        self._quota_blocked: set[Key] = set()  # the last pod creation was refused by a ResourceQuota
        self._lock = threading.Lock()

    def ensure(
        self,
        key: Key,
        model: dict,
        spec: ModelSpec,
        thash: str,
        pods: list[dict],
        cache: Gate | None,
        work: Pass,
    ) -> tuple[list[dict], bool]:
        """(the pods as last seen, whether the pass acted on them or waits for the watch to show its last
        writes: either way the watch's events bring the model back)."""
        plan, build = self._decide(key, model, spec, thash, pods, cache, work)
        if plan.is_noop:
            return pods, False
        unseen = self.watch.unseen_writes(key)
        if unseen:  # the watch has yet to show our last writes: acting now could do them twice
            work.later(unseen)
            return pods, True
        if unseen is not None:  # overdue: the cache cannot answer for this model, the API server can
            namespace, name = key
            log.warning("the watch has not shown pod writes for %s/%s in time: listing its pods", *key)
            pods, version = self.kube.listing("Pod", namespace, f"{MODEL_LABEL}={name}")
            self.watch.relisted(key, pods, version)
            plan, build = self._decide(key, model, spec, thash, pods, cache, work)
        elif (shown := self.watch.pods(key)) != pods:
            # `pods` was read before the watch showed our last writes: a plan on it would make them again
            # (a pod created in the last pass and missing from it is created twice: one too many)
            pods = shown
            plan, build = self._decide(key, model, spec, thash, pods, cache, work)
        if not plan.is_noop:
            self._apply(key, model, plan, build, work)
        return pods, not plan.is_noop

    def forget(self, key: Key) -> None:
        with self._lock:
            self._quota_blocked.discard(key)
        self.slots.forget(key)

    def _decide(
        self,
        key: Key,
        model: dict,
        spec: ModelSpec,
        thash: str,
        pods: list[dict],
        cache: Gate | None,
        work: Pass,
    ) -> tuple[PodPlan, Callable[[], dict] | None]:
        """The pod plan for what `pods` shows, and how to build a new pod."""
        observed = observe_pods(pods, self.settings, placement.card_resource_for(spec, self.settings))
        views = [v for v, _ in observed]
        hold = cache is not None and not cache.is_ready  # the new template waits for its cache
        if not hold and self.slots.must_wait(key, model, spec, thash, pods):
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
            build = lambda: clone_pod(template)  # noqa: E731
        else:
            surge, unavailable = spec.rollout.resolve(spec.replicas)
            quota_blocked = key in self._quota_blocked
            starving = quota_blocked or any(v.lacks_cards and v.template_hash == thash for v in views)
            plan = plan_pods(
                spec.replicas,
                thash,
                views,
                suspend=spec.suspend,
                budget=Budget(surge, unavailable),
                can_host=self._can_host(spec, views, pods) if starving else None,
                quota_blocked=quota_blocked,
            )
            build = lambda: build_pod(model, spec, self.settings)  # noqa: E731
        work.waiting = plan.waiting or work.waiting
        # stuck pods are replaced after their grace period: look again then
        for view, health in observed:
            if health.failure_reason and not view.is_dead and not view.is_terminating:
                work.later(self.settings.stuck_grace_seconds / 2)
        return plan, build

    def _apply(self, key: Key, model: dict, plan: PodPlan, build, work: Pass) -> None:
        """Each write, once the API server took it, is expected of the watch (watch.WatchCache.expect)."""
        ns = model["metadata"]["namespace"]
        for pod_name in plan.delete:
            try:
                self.kube.delete("Pod", pod_name, ns)
            except ApiException as e:
                work.problems.append(problem_of("Pod", e))
                continue
            self.watch.expect(key, created=[], deleted=[pod_name])
            reason = plan.reasons[pod_name]
            kind = "Warning" if reason.startswith(("pod ended", "stuck")) else "Normal"
            event = "PodReplaced" if kind == "Warning" else "PodDeleted"
            self.events.post(model, kind, event, f"deleted pod {pod_name}: {reason}", once=False)
        with self._lock:
            self._quota_blocked.discard(key)
        for _ in range(plan.create):
            try:
                pod = self.kube.create(build())
            except ApiException as e:
                problem = problem_of("Pod", e)
                if is_quota(e):
                    with self._lock:
                        self._quota_blocked.add(key)
                    # said now: the next pass deletes an old pod first and creates nothing refused, so
                    # this pass's status (and its Degraded Event) may be the only word of the quota, and a
                    # write conflict loses it (the Degraded Event has the same words: posted once)
                    self.events.post(model, "Warning", problem.reason, problem.message)
                work.problems.append(problem)
                break
            name = pod["metadata"]["name"]
            self.watch.expect(key, created=[name], deleted=[])
            self.events.post(model, "Normal", "PodCreated", f"created pod {name}", once=False)

    def _can_host(self, spec: ModelSpec, views: list[PodView], pods: list[dict]) -> frozenset[str] | None:
        """Old pods whose node could host a pod of the current template once they leave: the node
        matches the spec's nodeSelector and has the cards (its allocatable cards, less what other pods
        there hold, plus the leaving pod's). None when nodes cannot be read (namespaced RBAC) or the cards
        come by DRA (devices are not node capacity)."""
        if spec.devices is not None:
            return None
        res = placement.card_resource_for(spec, self.settings)
        by_name = {p["metadata"]["name"]: p for p in pods}
        hosts = set()
        try:
            for view in views:
                if view.template_hash == "" or not view.node or view.is_terminating:
                    continue
                node = self.kube.read_node(view.node)
                labels = node["metadata"].get("labels") or {}
                if any(labels.get(k) != v for k, v in spec.node_selector.items()):
                    continue
                allocatable = _cards(node["status"].get("allocatable", {}).get(res))
                used = sum(
                    _requested_cards(other, res)
                    for other in self.kube.pods_on_node(view.node)
                    if (other.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
                )
                if allocatable - used + _requested_cards(by_name[view.name], res) >= spec.cards:
                    hosts.add(view.name)
        except ApiException as e:
            if e.status in (401, 403):
                return None
            raise
        return frozenset(hosts)


class RolloutSlots:
    """A change of the operator's own settings (runtime image, card resource, ...) rolls out across models
    at most `limit` at a time; a change of the model's spec always rolls."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._rolling: set[Key] = set()  # models rolling out a change of the operator's settings
        self._lock = threading.Lock()

    def must_wait(self, key: Key, model: dict, spec: ModelSpec, thash: str, pods: list[dict]) -> bool:
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
            if any(lb.get(SPEC_LABEL) != spec_hash(model) for lb in labels):
                return False  # the user changed the spec
            if len(self._rolling) < self.limit:
                self._rolling.add(key)
                return False
            return True

    def forget(self, key: Key) -> None:
        with self._lock:
            self._rolling.discard(key)


def _pod_ready(pod: dict) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _serving_hash(views: list[PodView]) -> str | None:
    """The template most live pods run (ready ones first): the rollout that serves now."""
    live = [v for v in views if not v.is_terminating and not v.is_dead]
    if not live:
        return None
    counts = Counter((v.is_ready, v.template_hash) for v in live)
    return max(counts, key=lambda k: (counts[k] if k[0] else 0, counts[k]))[1]


def _requested_cards(pod: dict, resource: str) -> int:
    return sum(
        _cards(((c.get("resources") or {}).get("requests") or {}).get(resource))
        for c in pod["spec"]["containers"]
    )


def _cards(value) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0
