"""The pod plan: the rollout table and the rollout budget."""

from __future__ import annotations

import pytest
from spyre_operator.kinds.pods.plan import Budget, PodPlan, PodView, plan_pods
from spyre_operator.spec.model_spec import Rollout


def P(name, h="new", ready=False, term=False, cards=False, created="2026-01-01T00:00:00Z"):
    return PodView(name, h, ready, term, cards, created)


@pytest.mark.parametrize(
    ("replicas", "pods", "suspend", "expected"),
    [
        (2, [], False, PodPlan(2, ())),
        (2, [P("a", ready=True), P("b")], False, PodPlan(0, ())),
        # surge: new pods first, old pods stay while new ones warm up
        (2, [P("o1", "old", True), P("o2", "old", True)], False, PodPlan(2, ())),
        (2, [P("o1", "old", True), P("o2", "old", True), P("n1"), P("n2")], False, PodPlan(0, ())),
        # one new pod ready -> one old leaves
        (
            2,
            [P("o1", "old", True), P("o2", "old", True), P("n1", ready=True), P("n2")],
            False,
            PodPlan(0, ("o1",)),
        ),
        # unready old pods leave at once
        (2, [P("o1", "old"), P("n1"), P("n2")], False, PodPlan(0, ("o1",))),
        # scarce cards: a new pod cannot be scheduled -> free one old pod
        (
            2,
            [P("o1", "old", True), P("o2", "old", True), P("n1", cards=True), P("n2", cards=True)],
            False,
            PodPlan(0, ("o1",)),
        ),
        # ... but never a second while one old pod is still terminating
        (
            2,
            [P("o1", "old", True, term=True), P("o2", "old", True), P("n1", cards=True), P("n2", cards=True)],
            False,
            PodPlan(0, ()),
        ),
        # scale down: unready first, then newest
        (
            1,
            [P("a", ready=True, created="1"), P("b", ready=True, created="2"), P("c", created="0")],
            False,
            PodPlan(0, ("c", "b")),
        ),
        (0, [P("a", ready=True)], False, PodPlan(0, ("a",))),
        # terminating pods are not counted
        (1, [P("a", term=True)], False, PodPlan(1, ())),
        (3, [P("a", ready=True), P("b", "old")], True, PodPlan(0, ("a", "b"))),
    ],
)
def test_plan_table(replicas, pods, suspend, expected):
    plan = plan_pods(replicas, "new", pods, suspend)
    assert (plan.create, sorted(plan.delete)) == (expected.create, sorted(expected.delete))


def V(name, h="new", ready=False, term=False, cards=False, dead="", node="n1"):
    return PodView(name, h, ready, term, cards, f"2026-01-01T00:00:0{name[-1]}Z", node, dead)


@pytest.mark.parametrize(
    ("case", "replicas", "pods", "kw", "create", "delete", "waiting"),
    [
        # the bug of round 1: one replacement is still warming, the other lacks cards; the last old pod stays
        (
            "scarce-2-replicas-waits-for-ready",
            2,
            [V("o2", "old", True), V("n1"), V("n2", cards=True)],
            {},
            0,
            (),
            "availability budget of 1",
        ),
        (
            "scarce-2-replicas-then-frees-the-last",
            2,
            [V("o2", "old", True), V("n1", ready=True), V("n2", cards=True)],
            {},
            0,
            ("o2",),
            "",
        ),
        (
            "scarce-1-replica-is-replaced-in-place",
            1,
            [V("o1", "old", True), V("n1", cards=True)],
            {},
            0,
            ("o1",),
            "unavailable until",
        ),
        (
            "max-unavailable-0-never-frees",
            2,
            [V("o1", "old", True), V("o2", "old", True), V("n1", cards=True), V("n2", cards=True)],
            {"budget": Budget(2, 0)},
            0,
            (),
            "availability budget of 2",
        ),
        (
            "old-pod-on-a-node-that-cannot-host",
            2,
            [V("o1", "old", True), V("o2", "old", True), V("n1", cards=True), V("n2", cards=True)],
            {"can_host": frozenset({"o2"})},
            0,
            ("o2",),
            "",
        ),
        (
            "no-old-pod-can-host",
            2,
            [V("o1", "old", True), V("o2", "old", True), V("n1", cards=True), V("n2", cards=True)],
            {"can_host": frozenset()},
            0,
            (),
            "no old pod runs on a node",
        ),
        (
            "quota-blocked-acts-like-no-cards",
            2,
            [V("o1", "old", True), V("o2", "old", True)],
            {"quota_blocked": True, "budget": Budget(0, 1)},
            0,
            ("o1",),
            "",
        ),
        (
            "surge-1-creates-one-at-a-time",
            2,
            [V("o1", "old", True), V("o2", "old", True)],
            {"budget": Budget(1, 1)},
            1,
            (),
            "",
        ),
        (
            "evicted-pod-is-replaced",
            2,
            [V("a", ready=True), V("b", dead="pod ended (Failed): Evicted")],
            {},
            1,
            ("b",),
            "",
        ),
        (
            "stuck-pod-is-replaced",
            1,
            [V("a", dead="stuck in ImagePullBackOff for more than 120 s")],
            {},
            1,
            ("a",),
            "",
        ),
    ],
)
def test_rollout_budget_table(case, replicas, pods, kw, create, delete, waiting):
    plan = plan_pods(replicas, "new", pods, **kw)
    assert (plan.create, sorted(plan.delete)) == (create, sorted(delete)), case
    assert waiting in plan.waiting and (waiting or not plan.waiting or "unavailable" in plan.waiting)


@pytest.mark.parametrize(
    ("surge", "unavailable", "replicas", "expected"),
    [
        ("100%", 1, 4, (4, 1)),
        ("25%", "25%", 4, (1, 1)),
        ("25%", "25%", 3, (1, 0)),
        (0, 0, 2, (0, 1)),
        (1, "50%", 1, (1, 0)),
    ],
)
def test_rollout_resolves_like_a_deployment(surge, unavailable, replicas, expected):
    assert Rollout(surge, unavailable).resolve(replicas) == expected
