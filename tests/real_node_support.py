"""What the real-node tests share (tests/test_real_node.py): the tiny model's manifest, waiting on pods and
conditions, the operator installed by its chart on the node, a graph-cache volume the node can mount, and a
client that follows a Service's ready endpoints the way kube-proxy would. Test infrastructure."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client

from tests.cluster import images
from tests.cluster.node import host_volume as node_host_volume
from tests.cluster.node import operator_values
from tests.cluster.stack import LocalStack
from tests.httpclient import openai_client

NS = "real-node"
PROMPT = "The capital of France"
UID = 1000650000  # an arbitrary uid, as OpenShift's restricted SCC assigns one
SHAPE = (64, 16, 2)
MODEL_LABEL = "spyre-serve.io/model"


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


def is_ready(pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def model_manifest(name: str, **spec) -> dict:
    """A SpyreModel of the tiny modelcar image: eager, one static shape, no graph cache (unless `spec`
    says otherwise)."""
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


def install_operator(node, workdir: Path) -> LocalStack:
    """The CRD, then `helm install` of the chart with the operator image on the node's network (the test
    control plane's `kubernetes` Service is not routed: the operator dials the API server on 127.0.0.1)."""
    s = LocalStack(workdir, control_plane=node.cp)
    s.apply_crd()
    values = operator_values(node, UID)
    t0 = time.monotonic()
    s.install_operator(values, timeout=600)
    print(f"\n[real-node] operator Deployment ready in {time.monotonic() - t0:.1f} s (image pull included)")
    return s


def host_volume(stack: LocalStack, claim: str, folder: Path, size: str = "1Gi") -> str:
    return node_host_volume(stack.kube, NS, claim, folder, size)


def delete_model(stack: LocalStack, name: str) -> None:
    client.CustomObjectsApi(stack.kube).delete_namespaced_custom_object(
        "spyre-serve.io", "v1alpha1", NS, "spyremodels", name
    )


def patch_spec(stack: LocalStack, name: str, spec: dict) -> None:
    client.CustomObjectsApi(stack.kube).patch_namespaced_custom_object(
        "spyre-serve.io", "v1alpha1", NS, "spyremodels", name, {"spec": spec}
    )


def condition(stack: LocalStack, name: str, type_: str) -> dict:
    conditions = (stack.model(NS, name).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == type_), {})


def model_events(stack: LocalStack, name: str) -> list[tuple[str, str, str]]:
    """(type, reason, message) of the Events the operator posted on the model."""
    events = client.CoreV1Api(stack.kube).list_namespaced_event(
        NS, field_selector=f"involvedObject.name={name},involvedObject.kind=SpyreModel"
    )
    return [(e.type, e.reason, e.message) for e in events.items]


def model_pods(stack: LocalStack, name: str) -> list:
    return client.CoreV1Api(stack.kube).list_namespaced_pod(NS, label_selector=f"{MODEL_LABEL}={name}").items


def wait_ready(stack: LocalStack, name: str, replicas: int, timeout: float = 600) -> None:
    stack.wait(
        lambda: stack.is_ready(NS, name, replicas),
        timeout,
        f"{name} Ready with {replicas} replicas",
        lambda: stack.diagnose(NS, name),
    )


_HOST_ANSWERS: dict[int, str] = {}


def host_greedy_answer(tmp_path: Path, max_tokens: int = 4) -> str:
    """What the engine answers on the host for the same tiny model (same seed, same bytes); worked out once
    per `max_tokens` in a test process (the engine is deterministic: each test compared the same text)."""
    if max_tokens in _HOST_ANSWERS:
        return _HOST_ANSWERS[max_tokens]
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
        text = llm.generate([PROMPT], SamplingParams(max_tokens=max_tokens, temperature=0))[0].text
    finally:
        llm.close()
    _HOST_ANSWERS[max_tokens] = text
    return text


def ask(address: str, max_tokens: int = 4, timeout: float = 60) -> str:
    c = openai_client(f"http://{address}:8000/v1", timeout=timeout)
    return (
        c.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens, temperature=0)
        .choices[0]
        .text
    )


@dataclass
class EndpointClient:
    """A client that follows a Service's ready endpoints as kube-proxy would (the test control plane has
    none): it reads the EndpointSlices at most every `sync_seconds` (kube-proxy's minimum sync period,
    `--iptables-min-sync-period`, is 1 s) and sends to the next ready address, round robin, without retries.
    Runs in a thread until `stop()`; every request's (address, answer or error) is kept."""

    stack: LocalStack
    service: str
    sync_seconds: float = 1.0
    answers: list[tuple[str, str]] = field(default_factory=list)
    failures: list[tuple[str, str]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> EndpointClient:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=120)

    def _run(self) -> None:
        turn, synced, addresses = 0, 0.0, []
        while not self._stop.is_set():
            if time.monotonic() - synced >= self.sync_seconds:
                addresses, synced = self.stack.endpoints(NS, self.service), time.monotonic()
            if not addresses:
                self.failures.append(("", "no ready endpoint"))
                time.sleep(0.1)
                continue
            address = addresses[turn % len(addresses)]
            turn += 1
            try:
                self.answers.append((address, ask(address)))
            except Exception as e:  # any failed request is a finding
                self.failures.append((address, f"{type(e).__name__}: {e}"))
            time.sleep(0.05)

    def addresses_answered(self) -> set[str]:
        return {a for a, _ in self.answers}


def serving_pair(service: str, octet: int) -> tuple[bytes, bytes, bytes]:
    """(CA certificate, server certificate, server key), PEM, made for a test: the server's names are the
    Service's DNS names and every address the node's IPAM gives a pod (10.213.N.10-254; a pod's address is
    known only once it runs, after its Secret must exist)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "spyre-test-serving-ca")])

    def builder(subject: x509.Name, public_key) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    ca = (
        builder(ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    names = [f"{service}.{NS}.svc.cluster.local", f"{service}.{NS}.svc", f"{service}.{NS}", service]
    addresses = [ipaddress.ip_address(f"10.213.{octet}.{n}") for n in range(10, 255)]
    server = (
        builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]), key.public_key())
        .add_extension(
            x509.SubjectAlternativeName(
                [*(x509.DNSName(n) for n in names), *(x509.IPAddress(a) for a in addresses)]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return ca.public_bytes(pem), server.public_bytes(pem), key_pem


def caller_token(stack: LocalStack, account: str) -> str:
    """A ServiceAccount `account` in NS and a token of it from the TokenRequest API (as `kubectl create
    token` gets one)."""
    core = client.CoreV1Api(stack.kube)
    core.create_namespaced_service_account(NS, {"metadata": {"name": account}})
    body = {"spec": {"expirationSeconds": 3600}}
    return core.create_namespaced_service_account_token(account, NS, body).status.token


def let_call(stack: LocalStack, model: str, account: str) -> str:
    """A Role with `get` on spyremodels/`model` and a RoleBinding of it to `account` (security.md's
    example); returns the RoleBinding's name."""
    rbac = client.RbacAuthorizationV1Api(stack.kube)
    rule = {"apiGroups": ["spyre-serve.io"], "resources": ["spyremodels"], "resourceNames": [model]}
    rbac.create_namespaced_role(
        NS, {"metadata": {"name": f"{model}-caller"}, "rules": [{**rule, "verbs": ["get"]}]}
    )
    name = f"{model}-caller-{account}"
    binding = {
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"{model}-caller"},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": NS}],
    }
    rbac.create_namespaced_role_binding(NS, binding)
    return name
