"""What the pure operator tests build from: a model, specs and lookups they share."""

from __future__ import annotations

import datetime

from spyre_operator.kinds.pods.observe import observe_pod
from spyre_operator.settings import HASH_LABEL
from spyre_operator.spec.parse import parse_spec
from spyre_operator.status.conditions import compute_status

MODEL = {
    "apiVersion": "spyre-serve.io/v1alpha1",
    "kind": "SpyreModel",
    "metadata": {"name": "granite", "namespace": "ml", "uid": "u-1", "generation": 3},
    "spec": {
        "model": {"source": "pvc://models/granite-3b"},
        "cards": 4,
        "replicas": 2,
        "backend": "inductor",
        "batching": {
            "mode": "static",
            "shapes": [
                {"promptLength": 128, "newTokens": 64, "batchSize": 4},
                {"promptLength": 64, "newTokens": 20, "batchSize": 1},
            ],
        },
    },
}


def spec_of(**changes):
    return parse_spec("granite", {**MODEL["spec"], **changes})


def env_of(pod):
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def pod_dict(name, *, ready=False, unsched="", crash=False, h="h1", phase=None, node="", bound_at=""):
    """A pod's body: Running (warming up, or Ready) unless unschedulable or given another phase."""
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if unsched:
        conditions.append(
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": unsched}
        )
    if bound_at:
        conditions.append({"type": "PodScheduled", "status": "True", "lastTransitionTime": bound_at})
    status = {"conditions": conditions, "phase": phase or ("Pending" if unsched else "Running")}
    if crash:
        status["containerStatuses"] = [
            {
                "name": "runtime",
                "restartCount": 4,
                "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {"terminated": {"reason": "Error", "exitCode": 2}},
            }
        ]
    return {
        "metadata": {"name": name, "labels": {HASH_LABEL: h}, "creationTimestamp": "t"},
        "spec": {"nodeName": node} if node else {},
        "status": status,
    }


def status_for(pods, replicas=2, now=None, **kw):
    observed = [observe_pod(p, "ibm.com/spyre_pf", HASH_LABEL, now=now) for p in pods]
    return compute_status(
        generation=3,
        replicas=replicas,
        template_hash="h1",
        pods=[v for v, _ in observed],
        health=[h for _, h in observed],
        selector="s",
        service_address="http://x",
        card_resource="ibm.com/spyre_pf",
        **kw,
    )


def cond(status, type_):
    return {c["type"]: c for c in status["conditions"]}[type_]


NOW = datetime.datetime(2026, 11, 23, 12, 0, 0, tzinfo=datetime.UTC)


def pod(
    name, *, phase="Running", ready=True, waiting=None, last_message=None, created="2026-11-23T11:59:00Z"
):
    cs = {"name": "runtime", "image": "img:1", "restartCount": 3}
    if waiting:
        cs["state"] = {"waiting": {"reason": waiting, "message": "back-off"}}
    if last_message is not None:
        cs["lastState"] = {"terminated": {"reason": "Error", "exitCode": 2, "message": last_message}}
    status = {
        "phase": phase,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [cs],
    }
    if phase == "Failed":
        status.update(reason="Evicted", message="The node was low on resource: memory.")
    return {
        "metadata": {"name": name, "labels": {HASH_LABEL: "h"}, "creationTimestamp": created},
        "spec": {"nodeName": "n1"},
        "status": status,
    }


def status_of(pods, replicas=1, generation=2, **kw):
    observed = [observe_pod(p, "ibm.com/spyre_pf", HASH_LABEL, now=NOW) for p in pods]
    return compute_status(
        generation=generation,
        replicas=replicas,
        template_hash="h",
        pods=[v for v, _ in observed],
        health=[h for _, h in observed],
        selector="s",
        service_address=None,
        card_resource="ibm.com/spyre_pf",
        **kw,
    )


def kstatus(obj: dict) -> str:
    """kstatus's documented rules for a custom resource: observedGeneration behind -> InProgress;
    Stalled=True -> Failed; Reconciling=True -> InProgress; otherwise Current."""
    st = obj["status"]
    if st.get("observedGeneration") != obj["metadata"]["generation"]:
        return "InProgress"
    conds = {c["type"]: c["status"] for c in st.get("conditions") or []}
    if conds.get("Stalled") == "True":
        return "Failed"
    if conds.get("Reconciling") == "True":
        return "InProgress"
    return "Current"
