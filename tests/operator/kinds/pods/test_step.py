"""The pod step on the watch's view: it acts on what the watch shows once it shows the step's own last writes,
not on a view read before (the reconcile reads the pods early in its pass)."""

from __future__ import annotations

import itertools

from spyre_operator.io.watch import WatchCache
from spyre_operator.io.work import Pass
from spyre_operator.kinds.pods.step import PodStep
from spyre_operator.kinds.pods.template import pod_template, template_hash
from spyre_operator.settings import OperatorSettings

from tests.operator.objects import MODEL, spec_of

KEY = ("ml", "granite")


class FakeKube:
    """Creates pods as the API server does (generateName completed); deletes nothing it is not asked to."""

    def __init__(self) -> None:
        self.created: list[dict] = []
        self.deleted: list[str] = []
        self._suffix = itertools.count()

    def create(self, body: dict) -> dict:
        meta = {**body["metadata"], "name": f"{body['metadata']['generateName']}{next(self._suffix)}"}
        pod = {**body, "metadata": {**meta, "creationTimestamp": "2026-01-01T00:00:00Z"}}
        self.created.append(pod)
        return pod

    def delete(self, kind: str, name: str, namespace: str) -> None:
        self.deleted.append(name)


class Events:
    def post(self, *args, **kwargs) -> None:
        pass


def test_a_view_read_before_the_watch_showed_the_last_creations_makes_no_pod_twice():
    """The flake of test_scarce_cards_wait_then_replace_one_by_one: a pass created two pods; the next pass's
    view was read when the watch showed one of them, and the watch showed the other before the step asked
    whether its writes were seen. Acting on the older view created a third pod (then scaled down)."""
    settings, watch, kube = OperatorSettings(), WatchCache(), FakeKube()
    step = PodStep(settings, kube, Events(), watch)
    spec = spec_of(replicas=2)
    thash = template_hash(pod_template(KEY[1], spec, settings), spec.secret_digest)

    _, acted = step.ensure(KEY, MODEL, spec, thash, [], None, Pass())
    assert acted and len(kube.created) == 2
    first, second = kube.created
    watch.put_pod(KEY, first)
    view = watch.pods(KEY)  # the next pass reads its view: one of the two pods
    watch.put_pod(KEY, second)  # ... then the watch shows the other
    assert watch.unseen_writes(KEY) is None

    pods, acted = step.ensure(KEY, MODEL, spec, thash, view, None, Pass())
    assert (acted, len(kube.created), kube.deleted) == (False, 2, [])
    assert [p["metadata"]["name"] for p in pods] == [first["metadata"]["name"], second["metadata"]["name"]]
