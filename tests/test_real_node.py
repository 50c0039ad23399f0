"""End to end on a real node (issue 34): the runtime image built from Containerfile.runtime, run by containerd
and runc under a real kubelet 1.20, its cards handed out by the kubelet through the device-plugin API, its
model copied in by the modelcar init container of an `oci://` model image, answering the official OpenAI
client with the same greedy text the engine gives on the host. The pod is the one the operator builds
(manifests.pod_template), so its security context, volumes, probes and environment are the product's.

Needs root and the caches `make node` fills (tests/cluster/build-node.sh, build-images.sh)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import openai
import pytest
from kubernetes import client

from tests.cluster import images
from tests.cluster.controlplane import ControlPlane
from tests.cluster.deviceplugin import env_name
from tests.cluster.hoststate import FIXED_PATHS, SYSCTLS, mount_points
from tests.cluster.node import CARD_RESOURCE, RealNode, apiserver_args, missing_prerequisites

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]

NS = "real-node"
PROMPT = "The capital of France"
UID = 1000650000  # an arbitrary uid, as OpenShift's restricted SCC assigns one
SHAPE = (64, 16, 2)
CGROUPS = Path("/sys/fs/cgroup/memory")


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory):
    missing = missing_prerequisites(("pause", "runtime", "operator", "tiny-model"))
    if missing:
        pytest.fail("the real node is not built (run `make node`): missing " + ", ".join(missing))
    cp = ControlPlane(workdir=tmp_path_factory.mktemp("real-cp"), extra_apiserver_args=apiserver_args())
    cp.start()
    try:
        yield cp
    finally:
        cp.stop()


def host_snapshot(workdir: Path) -> dict:
    """What a node may change on the machine, limited to what is its own (image builds and other tests run
    beside it): sysctls, mounts under its folder and the fixed paths, bridges and veths, its cgroups, the
    fixed folders, and processes started from its folder."""
    owned = (str(workdir), *(str(p) for p in FIXED_PATHS))
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()]
    procs = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(workdir).encode() in (entry / "cmdline").read_bytes():
                    procs.append(entry.name)
            except OSError:
                pass
    return {
        "sysctls": {n: p.read_text().strip() for n in SYSCTLS if (p := Path("/proc/sys", n)).exists()},
        "mounts": sorted(m for m in mount_points() if m.startswith(owned)),
        "links": sorted(n for n in names if n.startswith(("spyrebr", "veth"))),
        "cgroups": sorted(
            p.name
            for p in Path("/sys/fs/cgroup/memory").iterdir()
            if p.name.startswith(("spyre-node", "kubepods"))
        ),
        "paths": {str(p): p.exists() for p in FIXED_PATHS},
        "processes": procs,
    }


def test_node_registers_runs_a_pod_and_puts_the_host_back(control_plane, tmp_path):
    """Runs first, on a node of its own: what the kubelet, containerd and CNI changed is gone afterwards."""
    before = host_snapshot(tmp_path)
    node = RealNode(control_plane, tmp_path / "node", name="spyre-kubelet-probe")
    try:
        node.start()
        core = client.CoreV1Api(control_plane.api_client())
        status = core.read_node(node.name).status
        assert status.node_info.container_runtime_version.startswith("containerd://")
        assert status.allocatable[CARD_RESOURCE] == "8"
        assert {a.type: a.address for a in status.addresses}["InternalIP"] == node.node_ip
        core.create_namespace({"metadata": {"name": "probe"}})
        pod = {
            "metadata": {"name": "sleeper", "namespace": "probe"},
            "spec": {
                "nodeName": node.name,
                "containers": [{"name": "pause", "image": images.pod_image("pause")}],
                "automountServiceAccountToken": False,
            },
        }
        core.create_namespaced_pod("probe", pod)
        wait_pod(core, "probe", "sleeper", 120, lambda p: p.status.phase == "Running")
        during = host_snapshot(tmp_path)
        assert during != before  # the node did change the host (bridge, mounts, cgroups) ...
    finally:
        node.stop()
    assert node.restore_problems == []
    assert host_snapshot(tmp_path) == before  # ... and put every bit of it back
    print(f"\n[real-node] node Ready with its cards in {node.ready_seconds:.1f} s")


@pytest.fixture(scope="module")
def node(control_plane, tmp_path_factory):
    with RealNode(control_plane, tmp_path_factory.mktemp("real-node")) as n:
        client.CoreV1Api(control_plane.api_client()).create_namespace({"metadata": {"name": NS}})
        yield n
    assert n.restore_problems == []


def wait_pod(core, namespace: str, name: str, timeout: float, predicate, what: str = "the pod"):
    deadline, pod = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        pod = core.read_namespaced_pod(name, namespace)
        if predicate(pod):
            return pod
        time.sleep(0.5)
    events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
    raise AssertionError(
        f"{what} {namespace}/{name} did not get there in {timeout:.0f} s; "
        f"status: {pod.status if pod else None}\n" + "\n".join(f"  {e.reason}: {e.message}" for e in events)
    )


def operator_pod(name: str) -> dict:
    """The serving pod the operator builds for an `oci://` tiny model (eager, one static shape, no cache)."""
    from spyre_contract.source_uri import parse_source_uri
    from spyre_operator.kinds.pods.template import pod_template
    from spyre_operator.settings import OperatorSettings
    from spyre_operator.spec.model_source import model_source
    from spyre_operator.spec.model_spec import GraphCache, ModelSpec, StaticShape

    spec = ModelSpec(
        source=model_source(parse_source_uri(f"oci://{images.pod_image('tiny-model')}")),
        served_model_name="tiny",
        backend="eager",
        shapes=(StaticShape(*SHAPE),),
        cache=GraphCache(enabled=False),
    )
    settings = OperatorSettings(runtime_image=images.pod_image("runtime"), run_as_user=UID)
    return {"metadata": {"name": name, "namespace": NS}, "spec": pod_template(name, spec, settings)}


def host_greedy_answer(tmp_path: Path) -> str:
    """What the engine answers on the host for the same tiny model (same seed, same bytes)."""
    from spyre_runtime.engine.llm import LLM
    from spyre_runtime.sampling.params import SamplingParams
    from spyre_runtime.testing.models import write_tiny_model

    env = {
        "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager",
        "SENDNN_INFERENCE_USE_CB": "0",
        "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": str(SHAPE[0]),
        "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": str(SHAPE[1]),
        "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": str(SHAPE[2]),
    }
    llm = LLM(write_tiny_model(tmp_path / "tiny"), environ=env)
    try:
        return llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0))[0].text
    finally:
        llm.close()


def test_runtime_image_serves_the_modelcar_model_on_the_real_node(node, tmp_path):
    cp, core = node.cp, client.CoreV1Api(node.cp.api_client())
    t0 = time.monotonic()
    core.create_namespaced_pod(NS, operator_pod("tiny-0"))
    pod = wait_pod(
        core,
        NS,
        "tiny-0",
        900,
        lambda p: any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or []),
        "the runtime pod to be Ready",
    )
    print(f"\n[real-node] runtime pod Ready in {time.monotonic() - t0:.1f} s (image pull included)")
    assert pod.spec.node_name == node.name and pod.status.pod_ip.startswith("10.213.")

    c = openai.OpenAI(
        base_url=f"http://{pod.status.pod_ip}:8000/v1", api_key="unused", max_retries=0, timeout=60
    )
    answer = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    assert answer == host_greedy_answer(tmp_path)

    def exec_(*cmd: str) -> subprocess.CompletedProcess:
        return cp.kubectl("exec", "-n", NS, "tiny-0", "-c", "runtime", "--", *cmd, check=False)

    ids = exec_("id", "-u").stdout.split() + exec_("id", "-G").stdout.split()
    assert ids[0] == str(UID) and "0" in ids[1:], ids  # the arbitrary uid, in group 0
    write = exec_("touch", "/models/written-by-the-pod")
    assert write.returncode != 0 and "Read-only file system" in write.stderr  # the model mount is read-only
    root = exec_("touch", "/opt/spyre-serve/x")
    assert root.returncode != 0 and "Read-only file system" in root.stderr  # so is the root filesystem
    cards = exec_("printenv", env_name(CARD_RESOURCE)).stdout.strip()
    assert cards.split(",") == node.plugin.allocations[-1] and len(cards.split(",")) == 1
    logs = cp.kubectl("logs", "-n", NS, "tiny-0", "-c", "runtime").stdout
    assert "/v1/completions" in logs or "Uvicorn running" in logs or logs.strip(), logs


# ---- the operator, installed by its chart from its image, on the real node -------------------------------


def model_manifest(name: str, **spec) -> dict:
    return {
        "apiVersion": "spyre-serve.io/v1alpha1",
        "kind": "SpyreModel",
        "metadata": {"name": name},
        "spec": {
            "model": {"source": f"oci://{images.pod_image('tiny-model')}", "servedModelName": "tiny"},
            "cards": 1,
            "replicas": 1,
            "backend": "eager",
            "batching": {
                "mode": "static",
                "shapes": [{"promptLength": SHAPE[0], "newTokens": SHAPE[1], "batchSize": SHAPE[2]}],
            },
            "graphCache": {"enabled": False},
            **spec,
        },
    }


@pytest.fixture(scope="module")
def stack(node, tmp_path_factory):
    """The CRD, then `helm install` of the chart with the operator image on the node's network (the test
    control plane's `kubernetes` Service is not routed: the operator dials the API server on 127.0.0.1)."""
    from tests.cluster.stack import LocalStack

    s = LocalStack(tmp_path_factory.mktemp("real-stack"), control_plane=node.cp)
    s.apply_crd()
    repository, tag = images.pod_image("operator").rsplit(":", 1)
    values = {
        "replicas": 1,
        "image": {"repository": repository, "tag": tag},
        "runtimeImage": images.pod_image("runtime"),
        "runtimePodSecurityContext": {"runAsUser": UID},
        "hostNetwork": True,
        "extraEnv": [
            {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
            {"name": "KUBERNETES_SERVICE_PORT", "value": str(node.cp.ports["kube-apiserver"])},
        ],
        "resyncSeconds": 3,
    }
    t0 = time.monotonic()
    s.install_operator(values, timeout=600)
    print(f"\n[real-node] operator Deployment ready in {time.monotonic() - t0:.1f} s (image pull included)")
    return s


def delete_model(stack, name: str) -> None:
    client.CustomObjectsApi(stack.kube).delete_namespaced_custom_object(
        "spyre-serve.io", "v1alpha1", NS, "spyremodels", name
    )


def condition(stack, name: str, type_: str) -> dict:
    conditions = (stack.model(NS, name).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == type_), {})


def test_chart_runs_the_operator_image_and_a_modelcar_model_becomes_ready(stack, node, tmp_path):
    core = client.CoreV1Api(stack.kube)
    operator = core.list_namespaced_pod(
        "spyre-system", label_selector="app.kubernetes.io/name=spyre-operator"
    ).items[0]
    assert operator.spec.node_name == node.name and operator.status.container_statuses[0].ready
    assert operator.status.container_statuses[0].image == images.pod_image("operator")
    stack.apply_model(NS, model_manifest("tiny"))
    stack.wait(lambda: stack.is_ready(NS, "tiny", 1), 900, "tiny Ready", lambda: stack.diagnose(NS, "tiny"))
    ips = stack.wait(lambda: stack.endpoints(NS, "tiny"), 60, "a ready endpoint")
    assert ips[0].startswith("10.213.")  # the pod's address on the node's bridge
    c = openai.OpenAI(base_url=f"http://{ips[0]}:8000/v1", api_key="unused", max_retries=0, timeout=60)
    answer = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    assert answer == host_greedy_answer(tmp_path)
    delete_model(stack, "tiny")


PULL_FAILURES = ("ErrImagePull", "ImagePullBackOff")


def test_an_image_that_does_not_exist_is_err_image_pull(stack):
    image = f"{images.REGISTRY_HOST}/spyre-serve/runtime:does-not-exist"
    stack.apply_model(NS, model_manifest("nopull", image=image))
    cond = stack.wait(
        lambda: (
            (c := condition(stack, "nopull", "Stalled")).get("reason") in ("ErrImagePull", "ImagePullBackOff")
            and c
        ),
        240,
        "Stalled ErrImagePull",
    )
    assert image in cond["message"] and "not found" in cond["message"], cond  # containerd's own words
    assert condition(stack, "nopull", "Ready")["status"] == "False"
    delete_model(stack, "nopull")


def test_a_missing_secret_is_create_container_config_error(stack):
    token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    stack.apply_model(NS, model_manifest("nosecret", env=[token]))
    cond = stack.wait(
        lambda: (
            (c := condition(stack, "nosecret", "Stalled")).get("reason") == "CreateContainerConfigError" and c
        ),
        240,
        "Stalled CreateContainerConfigError",
    )
    assert 'secret "hf" not found' in cond["message"], cond  # the kubelet's own words
    delete_model(stack, "nosecret")


def test_a_memory_limit_below_the_model_is_oom_killed(stack):
    resources = {"limits": {"memory": "150Mi"}, "requests": {"memory": "150Mi"}}
    stack.apply_model(NS, model_manifest("oom", resources=resources))
    cond = stack.wait(
        lambda: (
            (c := condition(stack, "oom", "Stalled")).get("reason") in ("CrashLoop", "ContainerFailed")
            and "OOMKilled" in c.get("message", "")
            and c
        ),
        300,
        "Stalled with OOMKilled",
        lambda: stack.diagnose(NS, "oom"),
    )
    assert "code 137" in cond["message"], cond
    delete_model(stack, "oom")
