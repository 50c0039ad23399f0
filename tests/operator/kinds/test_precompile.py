"""graphCache.precompile against the real control plane: a compile Job (no cards) fills the cache before
serving pods start; a new cache key starts a new Job while the old pods keep serving; a failed Job degrades
the model and stops the rollout. The kubelet stand-in completes (or fails) the Job's pods."""

from __future__ import annotations

import pytest
from kubernetes import client

from tests.conftest import wait_for
from tests.operator.test_reconcile import SHAPES_A, SHAPES_B, env_of, hashes, spec

pytestmark = pytest.mark.cluster


def compile_jobs(ns, name) -> list:
    batch = client.BatchV1Api(ns.kube)
    return batch.list_namespaced_job(ns.name, label_selector=f"spyre-serve.io/compile-for={name}").items


def test_compile_job_gates_rollout_and_its_failure_degrades(operator, ns):
    ns.kubelet.complete_jobs = False
    ns.apply_model("pc", spec(replicas=2, shapes=SHAPES_A, graphCache={"precompile": True}))
    (job,) = wait_for(lambda: compile_jobs(ns, "pc") or None, what="compile Job")
    container = job.spec.template.spec.containers[0]
    assert container.args[0] == "compile" and container.args[1] == "/models/tiny"
    assert "ibm.com/spyre_pf" not in (container.resources.requests or {})
    assert "SENDNN_INFERENCE_REQUIRE_PRECOMPILED_DECODERS" not in env_of(job.spec.template)
    key = job.metadata.labels["spyre-serve.io/cache-key"]
    wait_for(lambda: ns.condition("pc", "Progressing").get("reason") == "WaitingForCache", what="waiting")
    assert ns.condition("pc", "CacheReady")["status"] == "False" and ns.pods("pc") == []

    ns.kubelet.complete_jobs = True
    model = ns.wait_ready("pc", 2)
    assert model["status"]["cacheKey"] == key and ns.condition("pc", "CacheReady")["status"] == "True"
    assert all(env_of(p)["SENDNN_INFERENCE_REQUIRE_PRECOMPILED_DECODERS"] == "1" for p in ns.pods("pc"))
    old = hashes(ns, "pc")

    # a new configuration: a new Job; the rollout waits for it and the old pods keep serving
    ns.kubelet.complete_jobs = False
    ns.patch_spec("pc", {"batching": {"mode": "static", "shapes": SHAPES_B}})
    new_job = wait_for(
        lambda: next(
            (j for j in compile_jobs(ns, "pc") if j.metadata.labels["spyre-serve.io/cache-key"] != key), None
        ),
        what="second compile Job",
    )
    wait_for(lambda: ns.model("pc")["status"].get("cacheKey") != key, what="status names the new key")
    assert hashes(ns, "pc") == old and ns.condition("pc", "Progressing")["reason"] == "WaitingForCache"

    # the Job fails: Degraded with the Job's reason, still no new pods
    ns.kubelet.failing_jobs.add(new_job.metadata.name)
    wait_for(
        lambda: ns.condition("pc", "Degraded").get("reason") == "CompileJobFailed",
        timeout=90,
        what="Degraded",
    )
    degraded = ns.condition("pc", "Degraded")
    assert degraded["status"] == "True" and new_job.metadata.name in degraded["message"]
    assert hashes(ns, "pc") == old and len(ns.pods("pc")) == 2
    # the Event comes after the status write (the Degraded transition's)
    wait_for(lambda: any(e.reason == "CompileJobFailed" for e in ns.events("pc")), what="the Event")

    # a failed compile does not freeze healing: a serving pod that dies is replaced with its own template
    victim = ns.pods("pc")[0].metadata.name
    ns.kubelet.evict(victim)
    wait_for(
        lambda: victim not in [p.metadata.name for p in ns.pods("pc")] and len(ns.pods("pc")) == 2,
        what="the evicted serving pod replaced",
    )
    assert hashes(ns, "pc") == old
    # the Job is retried with back-off, then the model is Stalled, naming the attempts
    stalled = wait_for(
        lambda: (c := ns.condition("pc", "Stalled")).get("reason") == "CompileJobFailed" and c,
        timeout=90,
        what="Stalled after the last attempt",
    )
    assert "failed 3 of 3 attempts" in stalled["message"]
    attempts = [
        e for e in ns.events("pc") if e.reason == "CompileJobCreated" and new_job.metadata.name in e.message
    ]
    assert len(attempts) == 3
