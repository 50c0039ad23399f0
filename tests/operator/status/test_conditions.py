"""The status as a pure function of what was observed (kstatus conventions)."""

from __future__ import annotations

import datetime

import pytest
from spyre_operator.io.work import Problem
from spyre_operator.kinds.pods.observe import PodHealth
from spyre_operator.status.conditions import merge_conditions, status_changed

from tests.operator.objects import cond, kstatus, pod, pod_dict, status_for, status_of


def test_status_cases():
    ready = status_for([pod_dict("a", ready=True), pod_dict("b", ready=True)])
    assert ready["phase"] == "Ready" and cond(ready, "Ready")["status"] == "True"
    assert ready["readyReplicas"] == 2 and ready["observedGeneration"] == 3
    warming = status_for([pod_dict("a", ready=True), pod_dict("b")])
    assert cond(warming, "Progressing")["reason"] == "Warming" and cond(warming, "Ready")["status"] == "False"
    cards = status_for(
        [
            pod_dict("a", ready=True),
            pod_dict("b", unsched="0/2 nodes are available: 2 Insufficient ibm.com/spyre_pf."),
        ]
    )
    assert cond(cards, "Progressing")["reason"] == "WaitingForCards"
    crash = status_for([pod_dict("a", ready=True), pod_dict("b", crash=True)])
    assert cond(crash, "Degraded")["reason"] == "CrashLoop" and "code 2" in cond(crash, "Degraded")["message"]
    assert crash["phase"] == "Degraded"
    invalid = status_for([], invalid="spec.cards: must be one of 1, 2, 4, 8, got 3")
    assert cond(invalid, "Ready")["reason"] == "InvalidSpec" and cond(invalid, "Degraded")["status"] == "True"
    suspended = status_for([], suspended=True)
    assert suspended["phase"] == "Suspended" and cond(suspended, "Ready")["reason"] == "Suspended"


def test_pods_that_have_not_started_are_never_said_to_compile():

    now = datetime.datetime(2026, 11, 25, 12, 0, 0, tzinfo=datetime.UTC)
    bound = {"phase": "Pending", "node": "spyre-node-1", "bound_at": "2026-11-25T11:58:20Z"}  # 100 s ago
    ready = pod_dict("a", ready=True)
    starting = status_for([ready, pod_dict("b", **bound)], now=now, start_grace_seconds=300)
    progressing = cond(starting, "Progressing")
    assert progressing["reason"] == "Starting" and progressing["message"].endswith(
        "starting: b on spyre-node-1"
    )
    unscheduled = status_for([ready, pod_dict("b", phase="Pending")], now=now)
    assert cond(unscheduled, "Progressing")["message"].endswith("starting: b (not scheduled yet)")
    stuck = status_for([ready, pod_dict("b", **bound)], now=now, start_grace_seconds=60)
    progressing = cond(stuck, "Progressing")
    assert progressing["reason"] == "NotStarted" == cond(stuck, "Ready")["reason"]
    assert progressing["message"] == "pod b is bound to node spyre-node-1 and has not started after 100 s"
    assert cond(stuck, "Reconciling")["status"] == "True" and cond(stuck, "Stalled")["status"] == "False"
    # one pod warming up, another one not started: the one not started is what the condition says
    mixed = status_for(
        [ready, pod_dict("b"), pod_dict("c", **bound)], replicas=3, now=now, start_grace_seconds=60
    )
    assert cond(mixed, "Progressing")["reason"] == "NotStarted"
    claim = status_for(
        [ready, pod_dict("b", unsched='0/2 nodes are available: 2 persistentvolumeclaim "cache" not found.')]
    )
    progressing = cond(claim, "Progressing")
    assert (
        progressing["reason"] == "WaitingForClaim"
        and 'persistentvolumeclaim "cache" not found' in (progressing["message"])
    )
    dra = status_for([ready, pod_dict("b", unsched="0/2 nodes are available: 2 cannot allocate all claims.")])
    assert cond(dra, "Progressing")["reason"] == "WaitingForCards"
    taints = "0/2 nodes are available: 2 node(s) didn't match node selector."
    elsewhere = status_for([ready, pod_dict("b", unsched=taints)])
    assert cond(elsewhere, "Progressing")["reason"] == "Unschedulable"
    assert cond(elsewhere, "Progressing")["message"] == taints == cond(elsewhere, "Reconciling")["message"]


def test_status_written_only_when_changed_and_transition_times_kept():
    s1 = merge_conditions(status_for([pod_dict("a", ready=True), pod_dict("b")]), None)
    again = status_for([pod_dict("a", ready=True), pod_dict("b")])
    assert not status_changed(again, s1)
    s2 = merge_conditions(status_for([pod_dict("a", ready=True), pod_dict("b", ready=True)]), s1)
    assert status_changed(s2, s1)
    assert cond(s2, "Degraded")["lastTransitionTime"] == cond(s1, "Degraded")["lastTransitionTime"]
    assert PodHealth("x").failure_reason is None


@pytest.mark.parametrize(
    ("state", "pods", "kw", "generation", "expected", "ready"),
    [
        ("ready", [pod("a")], {}, 2, "Current", "True"),
        ("warming", [pod("a", ready=False)], {}, 2, "InProgress", "False"),
        ("no-pods-yet", [], {}, 2, "InProgress", "False"),
        ("stale-generation", [pod("a")], {}, 3, "InProgress", "True"),
        ("invalid-spec", [], {"invalid": "spec.cards: must be one of 1, 2, 4, 8"}, 2, "Failed", "False"),
        (
            "crash-loop",
            [pod("a", ready=False, waiting="CrashLoopBackOff", last_message="x")],
            {},
            2,
            "Failed",
            "False",
        ),
        ("image-never-pulls", [pod("a", ready=False, waiting="ImagePullBackOff")], {}, 2, "Failed", "False"),
        (
            "pod-rejected",
            [],
            {"problems": (Problem("PodRejected", 'Pod "x" is invalid'),)},
            2,
            "Failed",
            "False",
        ),
        (
            "api-error-retrying",
            [pod("a")],
            {"problems": (Problem("APIError", "503", False),)},
            2,
            "InProgress",
            "False",
        ),
        (
            "quota",
            [],
            {"problems": (Problem("QuotaExceeded", "exceeded quota", False),)},
            2,
            "InProgress",
            "False",
        ),
        ("suspended", [], {"suspended": True}, 2, "Current", "False"),
    ],
)
def test_kstatus_reads_every_state(state, pods, kw, generation, expected, ready):
    status = status_of(pods, **kw)
    obj = {"metadata": {"generation": generation}, "status": status}
    assert kstatus(obj) == expected, state
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["Ready"]["status"] == ready  # Ready is always present
    if expected == "Failed":
        assert conds["Stalled"]["message"] and conds["Ready"]["reason"] == conds["Stalled"]["reason"]
