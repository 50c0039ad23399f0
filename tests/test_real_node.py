"""End to end on a real node (issue 34): the runtime image built from Containerfile.runtime, run by containerd
and runc under a real kubelet 1.20, its cards handed out by the kubelet through the device-plugin API, its
model copied in by the modelcar init container of an `oci://` model image, answering the official OpenAI
client with the same greedy text the engine gives on the host. The pod is the one the operator builds
(kinds/pods/template.py), so its security context, volumes, probes and environment are the product's.

Then the operator, installed by its chart from its image, on the same node: the kubelet's own failures
(ErrImagePull, CreateContainerConfigError, OOMKilled, a failing readiness probe), the scheduler keeping a pod
that wants more cards than are free Pending, two inductor replicas sharing one graph-cache volume, a rolling
change and a deletion that lose no request, an `s3://` model fetched by the loader Job from moto on the
host, and the model pod's hardening as the kernel enforces it (issue 40). Who may call a model (issue 40),
the operator and the runtime together: HTTPS from the model's key pair, probed by the kubelet and verified by
the official client, and Kubernetes token authorization asked of the real API server by the pod's own
ServiceAccount. One node, one control plane and one operator for the module (tests/real_node_support.py).

Needs root and the caches `make node` fills (tests/cluster/build-node.sh, build-images.sh)."""

from __future__ import annotations

import base64
import contextlib
import datetime
import math
import re
import shutil
import ssl
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from kubernetes import client

from tests.cluster import images
from tests.cluster.controlplane import ControlPlane
from tests.cluster.deviceplugin import env_name
from tests.cluster.hoststate import FIXED_PATHS, SYSCTLS, mount_points
from tests.cluster.node import (
    CARD_RESOURCE,
    NodeError,
    RealNode,
    apiserver_args,
    check_free_disk,
    free_subnet_octet,
    missing_prerequisites,
    node_address,
)
from tests.real_node_support import (
    NS,
    PROMPT,
    SHAPE,
    UID,
    EndpointClient,
    ask,
    caller_token,
    condition,
    delete_model,
    host_greedy_answer,
    host_volume,
    install_operator,
    is_ready,
    let_call,
    model_events,
    model_manifest,
    model_pods,
    patch_spec,
    serving_pair,
    wait_pod,
    wait_ready,
)

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]
LONG_TOKENS = 64  # a second shape of the shared model: answers long enough to be in flight for a while


@pytest.fixture(scope="module")
def node_octet() -> int:
    """The shared node's pod subnet, 10.213.N.0/24, chosen first: the API server's certificate names the
    node's address, where its pods reach the API server (token authorization)."""
    return free_subnet_octet()


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory, node_octet):
    missing = missing_prerequisites(("pause", "runtime", "operator", "tiny-model"))
    if missing:
        pytest.fail("the real node is not built (run `make node`): missing " + ", ".join(missing))
    cp = ControlPlane(
        workdir=tmp_path_factory.mktemp("real-cp"),
        extra_apiserver_args=apiserver_args(),
        extra_ip_sans=(node_address(node_octet),),
    )
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


def test_a_disk_short_of_space_stops_the_node_before_it_starts_naming_the_disk(tmp_path):
    """A near-full disk would have the kubelet evict every pod with DiskPressure, one Event at a time."""
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(
        NodeError, match=rf"GiB free on the disk of {re.escape(str(tmp_path))}.*evicts pods below 1Gi"
    ):
        check_free_disk(tmp_path, need=free + 2**40)
    check_free_disk(tmp_path, need=min(free, 2**20))


def test_node_registers_runs_a_pod_and_puts_the_host_back(control_plane, tmp_path):
    """Runs first, on a node of its own: what the kubelet, containerd and CNI changed is gone afterwards."""
    node = RealNode(control_plane, tmp_path / "node", name="spyre-kubelet-probe")
    try:
        node.take_lock()  # the host as it is with no real node on it (another run's may be up until now)
        before = host_snapshot(tmp_path)
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
def node(control_plane, tmp_path_factory, node_octet):
    with RealNode(control_plane, tmp_path_factory.mktemp("real-node"), subnet_octet=node_octet) as n:
        client.CoreV1Api(control_plane.api_client()).create_namespace({"metadata": {"name": NS}})
        yield n
    assert n.restore_problems == []


# ---- the operator, installed by its chart from its image, on the real node -------------------------------


@pytest.fixture(scope="module")
def stack(node, tmp_path_factory):
    return install_operator(node, tmp_path_factory.mktemp("real-stack"))


@pytest.fixture(scope="module")
def tiny(stack):
    """The model the serving tests share, Ready with one replica; a second static shape with room for long
    answers (requests in flight for a while)."""
    shapes = [
        {"promptLength": SHAPE[0], "newTokens": SHAPE[1], "batchSize": SHAPE[2]},
        {"promptLength": 64, "newTokens": LONG_TOKENS, "batchSize": 4},
    ]
    static = {"mode": "static", "shapes": shapes}
    stack.apply_model(NS, model_manifest("tiny", batching=static))
    wait_ready(stack, "tiny", 1, 900)
    yield "tiny"
    with contextlib.suppress(client.ApiException):
        delete_model(stack, "tiny")


def test_chart_runs_the_operator_image_and_a_modelcar_model_becomes_ready(stack, node, tiny, tmp_path):
    core = client.CoreV1Api(stack.kube)
    operator = core.list_namespaced_pod(
        "spyre-system", label_selector="app.kubernetes.io/name=spyre-operator"
    ).items[0]
    assert operator.spec.node_name == node.name and operator.status.container_statuses[0].ready
    assert operator.status.container_statuses[0].image == images.pod_image("operator")
    ips = stack.wait(lambda: stack.endpoints(NS, tiny), 60, "a ready endpoint")
    assert ips[0].startswith("10.213.")  # the pod's address on the node's bridge
    assert ask(ips[0]) == host_greedy_answer(tmp_path)


def test_runtime_image_serves_the_modelcar_model_on_the_real_node(stack, node, tiny, tmp_path):
    """The shared model's pod, as the operator built it (pod_template) and the kubelet runs it: on the node's
    bridge, the arbitrary uid in group 0, the model the modelcar init container copied in mounted read-only,
    one card the kubelet got from the device plugin, the image's prebuilt kernel loaded from the read-only
    root filesystem, and the engine's greedy answer on the host."""
    (pod,) = [p for p in model_pods(stack, tiny) if is_ready(p)]
    name = pod.metadata.name
    assert pod.spec.node_name == node.name and pod.status.pod_ip.startswith("10.213.")
    c = openai.OpenAI(
        base_url=f"http://{pod.status.pod_ip}:8000/v1", api_key="unused", max_retries=0, timeout=60
    )
    answer = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    assert answer == host_greedy_answer(tmp_path)

    def exec_(*cmd: str) -> subprocess.CompletedProcess:
        return node.cp.kubectl("exec", "-n", NS, name, "-c", "runtime", "--", *cmd, check=False)

    ids = exec_("id", "-u").stdout.split() + exec_("id", "-G").stdout.split()
    assert ids[0] == str(UID) and "0" in ids[1:], ids  # the arbitrary uid, in group 0
    write = exec_("touch", "/models/written-by-the-pod")
    assert write.returncode != 0 and "Read-only file system" in write.stderr  # the model mount is read-only
    root = exec_("touch", "/opt/spyre-serve/x")
    assert root.returncode != 0 and "Read-only file system" in root.stderr  # so is the root filesystem
    cards = exec_("printenv", env_name(CARD_RESOURCE)).stdout.strip()
    assert cards.split(",") in node.plugin.allocations and len(cards.split(",")) == 1, cards
    logs = node.cp.kubectl("logs", "-n", NS, name, "-c", "runtime").stdout
    assert "/v1/completions" in logs or "Uvicorn running" in logs or logs.strip(), logs
    # the kernel the image built loads from the read-only root filesystem (it did not, at first)
    assert "Paged attention kernel unavailable" not in logs and "Paged attention kernel spyre_" in logs, logs


def test_a_bfloat16_kv_cache_reaches_the_runtime_under_the_kubelet(stack, node):
    """spec.kvCacheDtype as the kubelet runs it: the container's environment carries it, the runtime's
    memory plan counts the float32 model's cache in bfloat16, and the model answers."""
    stack.apply_model(NS, model_manifest("kvbf16", kvCacheDtype="bfloat16"))
    try:
        wait_ready(stack, "kvbf16", 1, 300)
        (pod,) = [p for p in model_pods(stack, "kvbf16") if is_ready(p)]
        name = pod.metadata.name
        env = node.cp.kubectl(
            "exec", "-n", NS, name, "-c", "runtime", "--", "printenv", "SENDNN_INFERENCE_KV_CACHE_DTYPE"
        )
        assert env.stdout.strip() == "bfloat16", env
        logs = node.cp.kubectl("logs", "-n", NS, name, "-c", "runtime").stdout
        assert "memory plan (float32, KV cache bfloat16" in logs, logs
        assert ask(pod.status.pod_ip)
    finally:
        delete_model(stack, "kvbf16")


def test_the_kubelet_runs_the_model_pod_hardened(stack, node, tiny):
    """Issue 40: the serving pod the operator made, as the kernel runs it: its root filesystem read-only (a
    write outside its volumes is EROFS, even where the image lets its user write), its volumes writable, no
    capability left, the runtime's default seccomp filter, no gaining privileges, and no service-account
    token mounted (the model does not use Kubernetes auth)."""
    (pod,) = [p for p in model_pods(stack, tiny) if is_ready(p)]
    container = pod.spec.containers[0].security_context
    assert container.read_only_root_filesystem and container.capabilities.drop == ["ALL"]
    assert container.allow_privilege_escalation is False and container.run_as_non_root
    assert pod.spec.security_context.seccomp_profile.type == "RuntimeDefault"
    assert pod.spec.automount_service_account_token is False

    def exec_(*cmd: str) -> subprocess.CompletedProcess:
        return node.cp.kubectl("exec", "-n", NS, pod.metadata.name, "-c", "runtime", "--", *cmd, check=False)

    for path in ("/hardening-check", "/opt/app-root/src/hardening-check"):  # the latter: group 0 may write
        write = exec_("touch", path)
        assert write.returncode != 0 and "Read-only file system" in write.stderr, (path, write.stderr)
    for volume in ("/tmp", "/dev/shm"):  # emptyDirs
        write = exec_("sh", "-c", f"echo ok > {volume}/hardening-check && cat {volume}/hardening-check")
        assert write.returncode == 0 and write.stdout.strip() == "ok", (volume, write.stderr)
        exec_("rm", f"{volume}/hardening-check")
    status = dict(
        line.split(":", 1) for line in exec_("cat", "/proc/self/status").stdout.splitlines() if ":" in line
    )
    status = {k: v.strip() for k, v in status.items()}
    assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0, status
    assert int(status["CapBnd"], 16) == 0, status  # dropped, not only unused
    assert status["Seccomp"] == "2" and status["NoNewPrivs"] == "1", status  # 2: a filter (RuntimeDefault)
    token = exec_("ls", "/var/run/secrets/kubernetes.io/serviceaccount")
    assert token.returncode != 0 and "No such file or directory" in token.stderr, token
    assert "serviceaccount" not in exec_("cat", "/proc/self/mounts").stdout


# ---- who may call a model (issue 40): HTTPS and token authorization, the operator and the runtime together


TLS_MODEL, TOKEN_MODEL = "tiny-tls", "tiny-token"
AUTH_CACHE_SECONDS = 2  # spec.env SPYRE_AUTH_CACHE_SECONDS: how long a revoked RoleBinding may still pass


@pytest.fixture(scope="class")
def secured(stack, node, tmp_path_factory):
    """One model per mode, started together: `tiny-tls` serving HTTPS with a key pair of a test CA (whose
    file this yields), `tiny-token` authorizing Kubernetes tokens. The pods reach the API server as pods of a
    cluster do, by KUBERNETES_SERVICE_HOST and their ServiceAccount's mounted token; here the address is the
    node's relay (no kube-proxy routes the `kubernetes` Service), set through spec.env."""
    core = client.CoreV1Api(stack.kube)
    ca, crt, key = serving_pair(TLS_MODEL, node.subnet_octet)
    ca_file = tmp_path_factory.mktemp("secured") / "ca.crt"
    ca_file.write_bytes(ca)
    data = {"tls.crt": base64.b64encode(crt).decode(), "tls.key": base64.b64encode(key).decode()}
    secret = {"metadata": {"name": f"{TLS_MODEL}-tls"}, "type": "kubernetes.io/tls", "data": data}
    core.create_namespaced_secret(NS, secret)
    host, port = node.api_server_for_pods()
    env = [
        {"name": "KUBERNETES_SERVICE_HOST", "value": host},
        {"name": "KUBERNETES_SERVICE_PORT", "value": str(port)},
        {"name": "SPYRE_AUTH_CACHE_SECONDS", "value": str(AUTH_CACHE_SECONDS)},
    ]
    stack.apply_model(NS, model_manifest(TLS_MODEL, tls={"secretName": f"{TLS_MODEL}-tls"}))
    stack.apply_model(NS, model_manifest(TOKEN_MODEL, auth={"kubernetes": {}}, env=env))
    try:
        yield ca_file
    finally:
        for name in (TLS_MODEL, TOKEN_MODEL):
            with contextlib.suppress(client.ApiException):
                delete_model(stack, name)
        core.delete_namespaced_secret(f"{TLS_MODEL}-tls", NS)


@pytest.mark.usefixtures("secured")
class TestWhoMayCallAModel:
    def test_https_with_the_secret_key_pair_and_a_missing_secret_is_no_crash_loop(self, stack, secured):
        """The kubelet's HTTPS probes make the pod Ready; the official client, verifying against the test
        CA, gets a completion at the pod's address; plain HTTP on the same port fails, and so does a client
        that does not trust the CA. A model whose Secret does not exist: a condition and a Warning naming
        it, and no pod at all."""
        stack.apply_model(NS, model_manifest("tls-missing", tls={"secretName": "absent-tls"}))
        try:
            cond = stack.wait(
                lambda: (
                    (c := condition(stack, "tls-missing", "Degraded")).get("reason") == "SecretNotFound" and c
                ),
                60,
                "Degraded SecretNotFound",
            )
            assert "Secret absent-tls (spec.tls.secretName) does not exist" in cond["message"], cond
            stack.wait(
                lambda: any(
                    t == "Warning" and r == "SecretNotFound" and "absent-tls" in m
                    for t, r, m in model_events(stack, "tls-missing")
                ),
                30,
                "a Warning naming the Secret",
            )
            for _ in range(6):  # a few seconds: no pod is made, so none can crash-loop
                assert model_pods(stack, "tls-missing") == []
                time.sleep(0.5)
            assert condition(stack, "tls-missing", "Ready")["status"] == "False"
        finally:
            delete_model(stack, "tls-missing")

        wait_ready(stack, TLS_MODEL, 1, 600)
        (pod,) = [p for p in model_pods(stack, TLS_MODEL) if is_ready(p)]
        container = pod.spec.containers[0]
        probes = (container.startup_probe, container.readiness_probe, container.liveness_probe)
        assert [p.http_get.scheme for p in probes] == ["HTTPS"] * 3  # the kubelet probed it over HTTPS
        assert stack.model(NS, TLS_MODEL)["status"]["serviceAddress"].startswith("https://")
        ip = pod.status.pod_ip
        with httpx.Client(verify=ssl.create_default_context(cafile=secured)) as http:
            c = openai.OpenAI(
                base_url=f"https://{ip}:8000/v1",
                api_key="unused",
                max_retries=0,
                timeout=60,
                http_client=http,
            )
            done = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
        assert done.choices[0].text and done.usage.completion_tokens >= 1
        with pytest.raises(httpx.TransportError):  # the TLS port does not speak plain HTTP
            httpx.get(f"http://{ip}:8000/health", timeout=10)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):  # nor trust by default
            httpx.get(f"https://{ip}:8000/health", timeout=10)

    def test_kubernetes_tokens_a_role_binding_gives_access_and_its_removal_takes_it_away(self, stack, node):
        """The runtime, as the model's ServiceAccount with its mounted token, asks the real API server: a
        caller ServiceAccount with a RoleBinding to `get` the model gets its completion (200), one without
        a 403, garbage a 401, and once its RoleBinding is deleted the first caller gets 403 within the
        cache time."""
        tokens = {account: caller_token(stack, account) for account in ("chat-app", "stranger")}
        binding = let_call(stack, TOKEN_MODEL, "chat-app")
        wait_ready(stack, TOKEN_MODEL, 1, 600)
        (pod,) = [p for p in model_pods(stack, TOKEN_MODEL) if is_ready(p)]
        assert pod.spec.service_account_name == f"{TOKEN_MODEL}-runtime"
        mounted = node.cp.kubectl(
            "exec", "-n", NS, pod.metadata.name, "-c", "runtime", "--",
            "ls", "/var/run/secrets/kubernetes.io/serviceaccount/token", check=False,
        )  # fmt: skip
        assert mounted.returncode == 0, mounted.stderr
        ip = pod.status.pod_ip

        def caller(token: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"http://{ip}:8000/v1", api_key=token, max_retries=0, timeout=60)

        done = caller(tokens["chat-app"]).completions.create(
            model="tiny", prompt=PROMPT, max_tokens=4, temperature=0
        )
        assert done.choices[0].text and done.usage.completion_tokens >= 1
        with pytest.raises(openai.PermissionDeniedError) as denied:
            caller(tokens["stranger"]).models.list()
        assert denied.value.status_code == 403
        assert (
            f"system:serviceaccount:{NS}:stranger may not get spyremodels.spyre-serve.io '{TOKEN_MODEL}'"
            in denied.value.message
        )
        with pytest.raises(openai.AuthenticationError) as garbage:
            caller("garbage.token.value").models.list()
        assert garbage.value.status_code == 401

        client.RbacAuthorizationV1Api(stack.kube).delete_namespaced_role_binding(binding, NS)
        revoked = time.monotonic()

        def refused() -> bool:
            try:
                caller(tokens["chat-app"]).models.list()
            except openai.PermissionDeniedError:
                return True
            return False

        stack.wait(refused, 30, "a 403 once the RoleBinding is gone")
        took = time.monotonic() - revoked
        print(
            f"\n[real-node] a revoked RoleBinding refused after {took:.1f} s (cache {AUTH_CACHE_SECONDS} s)"
        )
        assert took < AUTH_CACHE_SECONDS + 10  # the cache time plus RBAC's propagation
        logs = node.cp.kubectl("logs", "-n", NS, pod.metadata.name, "-c", "runtime").stdout
        assert "in-cluster ServiceAccount" in logs, logs  # its own identity, as a pod of a cluster has it
        assert not any(t in logs for t in tokens.values())


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


# ---- cards, probes, rollouts and drains, decided by the kubelet and the scheduler -------------------------


def free_cards(stack, node) -> int:
    """The node's allocatable cards less what its pods that still hold cards request (the scheduler's sum)."""
    core = client.CoreV1Api(stack.kube)
    allocatable = int(core.read_node(node.name).status.allocatable[CARD_RESOURCE])
    pods = core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node.name}").items
    used = sum(
        int(((c.resources.requests or {}) if c.resources else {}).get(CARD_RESOURCE, 0))
        for p in pods
        if p.status.phase not in ("Succeeded", "Failed")
        for c in p.spec.containers
    )
    return allocatable - used


def test_more_cards_than_are_free_stay_pending_and_the_operator_says_so(stack, node):
    """Every free card goes to a pod of the test's; the model's pod then waits, Pending, with the scheduler's
    words in the model's condition and a Warning Event; once those cards are free the scheduler binds it and
    the kubelet hands it a card through the device plugin."""
    core = client.CoreV1Api(stack.kube)

    def settled() -> bool:  # no pod on the node is on its way out (its cards would free meanwhile)
        pods = core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node.name}").items
        return not any(p.metadata.deletion_timestamp for p in pods)

    stack.wait(settled, 180, "the node's leaving pods to be gone")
    taken = free_cards(stack, node)
    assert taken >= 1
    holder = {
        "metadata": {"name": "card-holder", "namespace": NS},
        "spec": {
            "containers": [
                {
                    "name": "pause",
                    "image": images.pod_image("pause"),
                    "resources": {"limits": {CARD_RESOURCE: str(taken)}},
                }
            ],
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 0,
        },
    }
    core.create_namespaced_pod(NS, holder)
    wait_pod(core, NS, "card-holder", 120, lambda p: p.status.phase == "Running", "the card holder")
    assert node.plugin.allocations[-1] and len(node.plugin.allocations[-1]) == taken
    stack.apply_model(NS, model_manifest("starved"))
    cond = stack.wait(
        lambda: (c := condition(stack, "starved", "Reconciling")).get("reason") == "WaitingForCards" and c,
        120,
        "Reconciling WaitingForCards",
        lambda: stack.diagnose(NS, "starved"),
    )
    assert f"Insufficient {CARD_RESOURCE}" in cond["message"], cond  # the scheduler's own words
    assert cond["status"] == "True" and condition(stack, "starved", "Ready")["status"] == "False"
    (pod,) = model_pods(stack, "starved")
    assert pod.status.phase == "Pending" and not pod.spec.node_name
    events = model_events(stack, "starved")
    assert any(t == "Warning" and r == "WaitingForCards" and CARD_RESOURCE in m for t, r, m in events), events

    allocated = len(node.plugin.allocations)
    core.delete_namespaced_pod("card-holder", NS, grace_period_seconds=0)
    stack.wait(
        lambda: len(node.plugin.allocations) > allocated, 120, "the kubelet to allocate the freed card"
    )
    (pod,) = model_pods(stack, "starved")
    assert pod.spec.node_name == node.name and len(node.plugin.allocations[-1]) == 1
    stack.wait(
        lambda: condition(stack, "starved", "Reconciling").get("reason") != "WaitingForCards",
        60,
        "the model to stop waiting for cards",
    )
    delete_model(stack, "starved")


def ctr(node, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ctr", "--address", str(node.containerd_socket), "-n", "k8s.io", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_a_pod_that_fails_its_readiness_probe_is_not_ready_and_the_operator_says_so(stack, node, tiny):
    """The serving pod's container is frozen (containerd pauses its cgroup): the kubelet's readiness probe
    times out, the pod leaves the Service's ready endpoints and the model says which pod fails its probe;
    thawed, it serves again."""
    (pod,) = [p for p in model_pods(stack, tiny) if is_ready(p)]
    container = pod.status.container_statuses[0].container_id.split("://", 1)[1]
    frozen = ctr(node, "tasks", "pause", container)
    assert frozen.returncode == 0, frozen.stderr
    try:
        cond = stack.wait(
            lambda: (c := condition(stack, tiny, "Ready")).get("reason") == "NotReady" and c,
            90,
            "Ready False NotReady",
            lambda: stack.diagnose(NS, tiny),
        )
        assert cond["status"] == "False" and pod.metadata.name in cond["message"]
        assert "readiness probe" in cond["message"], cond
        assert stack.endpoints(NS, tiny) == []
        assert condition(stack, tiny, "Stalled")["status"] == "False"  # the kubelet may still heal it
        # kopf posts Events from a queue of its own, so the Event may land a moment after the condition
        stack.wait(
            lambda: any(t == "Warning" and r == "NotReady" for t, r, _ in model_events(stack, tiny)),
            30,
            "a Warning NotReady Event",
            lambda: str(model_events(stack, tiny)),
        )
    finally:
        ctr(node, "tasks", "resume", container)
        wait_ready(stack, tiny, 1, 120)  # the next test starts from a serving pod even when this one failed
    assert ask(stack.endpoints(NS, tiny)[0])


def test_a_rolling_change_fails_no_request_of_a_client_that_follows_the_ready_endpoints(stack, tiny):
    wait_ready(stack, tiny, 1, 120)
    before = {p.metadata.name for p in model_pods(stack, tiny)}
    old_address = stack.endpoints(NS, tiny)
    follower = EndpointClient(stack, tiny).start()
    try:
        time.sleep(2)
        generation = stack.model(NS, tiny)["metadata"]["generation"]
        patch_spec(stack, tiny, {"env": [{"name": "SPYRE_TEST_ROLLOUT", "value": "2"}]})
        stack.wait(lambda: stack.model(NS, tiny)["metadata"]["generation"] > generation, 30, "the new spec")
        stack.wait(
            lambda: (
                stack.is_ready(NS, tiny, 1)
                and not before & {p.metadata.name for p in model_pods(stack, tiny)}
            ),
            300,
            "the new pod Ready and the old one gone",
            lambda: stack.diagnose(NS, tiny),
        )
        time.sleep(2)
    finally:
        follower.stop()
    new_address = stack.endpoints(NS, tiny)
    assert new_address != old_address
    assert follower.failures == []
    assert set(old_address + new_address) <= follower.addresses_answered()  # both served during the change


def test_deleting_the_model_drains_in_flight_requests_within_the_grace_period(stack, tiny, tmp_path):
    """Answers in flight when the model is deleted: the garbage collector deletes its pod, the kubelet runs
    its preStop hook and then sends SIGTERM, the runtime stops admitting (503) and finishes every request it
    had admitted, then exits before the termination grace period is over. Two clients keep sending to the
    pod's own address (held connections), so requests are in flight when SIGTERM comes; each request that
    started before it must be answered whole (one started after may be refused, 503 or reset)."""
    (pod,) = model_pods(stack, tiny)
    address, name = pod.status.pod_ip, pod.metadata.name
    grace = pod.spec.termination_grace_period_seconds
    kubectl = [str(stack.cp.bin_dir / "kubectl"), "--kubeconfig", str(stack.cp.kubeconfig)]
    log_file = tmp_path / "runtime.log"
    logs = subprocess.Popen(
        [*kubectl, "logs", "-f", "-n", NS, name, "-c", "runtime"],
        stdout=log_file.open("w"),
        stderr=subprocess.STDOUT,
    )
    # `logs -f` ends when the container exits: the runtime's exit, timed apart from the kubelet's bookkeeping
    # after it (its final delete of the pod object once came at the grace period's end, 50 s after the exit)
    log_ended: list[float] = []
    threading.Thread(target=lambda: (logs.wait(), log_ended.append(time.monotonic())), daemon=True).start()
    # (outcome, wall-clock times: "start", "sent" once the whole request went out, "end"); a request is judged
    # by when it was sent, not by when its thread began it (that can be a second earlier on a loaded machine)
    results: list[tuple[str, dict[str, float]]] = []
    stop = threading.Event()
    timeout = httpx.Timeout(120, connect=3)
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": LONG_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }

    def send() -> None:
        while not stop.is_set():
            times = {"start": time.time()}

            def trace(event: str, _info: dict, times: dict = times) -> None:
                if event == "http11.send_request_body.complete":
                    times["sent"] = time.time()

            try:
                with httpx.Client(timeout=timeout) as http:  # a new connection each time, as before
                    r = http.post(
                        f"http://{address}:8000/v1/completions", json=body, extensions={"trace": trace}
                    )
                whole = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == LONG_TOKENS
                outcome = "ok" if whole else str(r.status_code)
            except (httpx.ConnectError, httpx.ConnectTimeout):  # the server is gone
                outcome = "refused"
            except httpx.HTTPError as e:
                outcome = f"cut: {type(e).__name__}: {e}"
            times["end"] = time.time()
            results.append((outcome, times))
            if outcome == "refused":
                return
            if outcome != "ok":
                time.sleep(0.1)

    senders = [threading.Thread(target=send, daemon=True) for _ in range(2)]
    for t in senders:
        t.start()
    try:
        stack.wait(lambda: sum(o == "ok" for o, _ in results) >= 2, 120, "answers before the delete")
        t_delete = time.monotonic()
        delete_model(stack, tiny)
        core = client.CoreV1Api(stack.kube)
        # the pod object goes when the kubelet has cleaned up after the exit: behind another pod's 2-minute
        # wait for its volumes (an earlier test's), that came 93 s after the delete, past the grace period
        stack.wait(
            lambda: name not in {p.metadata.name for p in core.list_namespaced_pod(NS).items},
            grace + 150,
            "the pod to be gone",
        )
        gone = time.monotonic() - t_delete
    finally:
        stop.set()
        for t in senders:
            t.join(timeout=150)
        with contextlib.suppress(subprocess.TimeoutExpired):
            logs.wait(timeout=30)
        logs.kill()
    text = log_file.read_text(errors="replace")
    line = next((x for x in text.splitlines() if "SIGTERM: draining" in x), "")
    assert line and "grace period over" not in text, text[-2000:]
    sigterm = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=datetime.UTC)
    drained = int(line.split("SIGTERM: draining ", 1)[1].split()[0])
    assert "Finished server process" in text and log_ended, text[-2000:]  # the log was followed to the exit
    exited = log_ended[0] - t_delete
    print(
        f"\n[real-node] runtime exited {exited:.1f} s and pod gone {gone:.1f} s after the delete, {drained} "
        f"requests in flight at SIGTERM; outcomes {sorted({o for o, _ in results})}"
    )
    assert exited < grace, (exited, gone)
    assert drained >= 1, text[-2000:]  # requests were in flight when SIGTERM came ...
    before = [(o, t) for o, t in results if t.get("sent", math.inf) < sigterm.timestamp() - 0.5]
    lost = [(o, {k: round(v - sigterm.timestamp(), 2) for k, v in t.items()}) for o, t in before if o != "ok"]
    # ... and every one admitted before it was answered (times of any that was not, from SIGTERM)
    assert before and not lost, (lost, text[-3000:])


def test_two_replicas_share_the_graph_cache(stack, tmp_path):
    """Two replicas (inductor, the graph cache on one volume): one compiles and publishes its graphs, the
    other waits on the key's lock and loads them."""
    folder = tmp_path / "graph-cache"
    volume = host_volume(stack, "shared-graph-cache", folder)
    cache = {"enabled": True, "size": "1Gi"}
    stack.apply_model(NS, model_manifest("shared", backend="inductor", replicas=2, graphCache=cache))
    try:
        wait_ready(stack, "shared", 2, 900)
        pods = model_pods(stack, "shared")
        logs = [stack.cp.kubectl("logs", "-n", NS, p.metadata.name, "-c", "runtime").stdout for p in pods]
        found = [
            re.search(r"Graph cache (hit|miss) for key (\S+); (\d+) graphs compiled", log) for log in logs
        ]
        assert all(found), logs
        (hit, hit_key, _), (miss, miss_key, compiled) = sorted(m.groups() for m in found)
        assert (hit, miss) == ("hit", "miss") and hit_key == miss_key and int(compiled) > 0
        assert (folder / "graphs/entries" / miss_key / "manifest.json").is_file()  # on the shared volume
        assert len(list((folder / "graphs/entries").iterdir())) == 1  # the second replica published nothing
        answers = {ask(p.status.pod_ip) for p in pods}
        assert len(answers) == 1, answers  # the loaded graphs answer as the compiled ones
    finally:
        delete_model(stack, "shared")
        core = client.CoreV1Api(stack.kube)
        core.delete_namespaced_persistent_volume_claim("shared-graph-cache", NS)
        core.delete_persistent_volume(volume)


def test_an_s3_model_comes_through_the_loader_job_in_a_container(stack, node, tmp_path):
    """moto on the host, reached by the loader Job's pod on the node's bridge address: the Job copies the
    model into the model cache on the graph-cache volume, and the serving pod serves it from there."""
    from spyre_runtime.testing.models import write_tiny_model

    from tests.cluster.s3server import S3Server

    s3 = S3Server(tmp_path / "s3", proxy_host=node.node_ip).start()
    core = client.CoreV1Api(stack.kube)
    volume = host_volume(stack, "from-s3-graph-cache", tmp_path / "cache")
    try:
        s3.put_folder("models", "tiny", write_tiny_model(tmp_path / "tiny"))
        core.create_namespaced_secret(NS, {"metadata": {"name": "s3-creds"}, "stringData": s3.credentials})
        source = {"source": "s3://models/tiny", "servedModelName": "tiny", "secretRef": "s3-creds"}
        model = {**source, "endpoint": s3.endpoint}
        stack.apply_model(
            NS, model_manifest("from-s3", model=model, graphCache={"enabled": True, "size": "1Gi"})
        )
        wait_ready(stack, "from-s3", 1, 600)
        cached = condition(stack, "from-s3", "ModelCached")
        assert (cached["status"], cached["reason"]) == ("True", "Cached"), cached
        gets = s3.object_gets("models")
        assert any("model.safetensors" in g for g in gets), gets  # the loader read the model
        (pod,) = model_pods(stack, "from-s3")
        assert ask(pod.status.pod_ip) == host_greedy_answer(tmp_path / "host")
        assert list((tmp_path / "cache/models").glob("*/config.json"))  # the model cache on the volume
    finally:
        with contextlib.suppress(client.ApiException):
            delete_model(stack, "from-s3")
        with contextlib.suppress(client.ApiException):
            core.delete_namespaced_persistent_volume_claim("from-s3-graph-cache", NS)
        core.delete_persistent_volume(volume)
        s3.stop()
