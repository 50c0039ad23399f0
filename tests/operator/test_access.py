"""Who may call a model (spec.auth, spec.tls), the operator's half on the real control plane (1.20, no CEL:
the operator's own checks): the Secrets' conditions and Events, the rollout a new key makes, token
authorization's identity made and removed, the HTTPS pod and Service; and no secret value in any pod
argument, status, Event or operator log."""

from __future__ import annotations

import base64
import datetime

import pytest
from kubernetes import client

from tests.conftest import wait_for

pytestmark = pytest.mark.cluster

SHAPES = [{"promptLength": 64, "newTokens": 20, "batchSize": 1}]
# the secret values of this module: the scan looks for each in everything the operator writes
KEY_ONE, KEY_TWO = "sk-first-9f2c41d7e8", "sk-second-5a0be3c6d1"


def spec(**extra) -> dict:
    return {
        "model": {"source": "pvc://models/tiny"},
        "replicas": 1,
        "backend": "inductor",
        "batching": {"mode": "static", "shapes": SHAPES},
        **extra,
    }


def api_key(name="model-key", key="api-key") -> dict:
    return {"apiKey": {"secretRef": {"name": name, "key": key}}}


def put_secret(ns, name: str, data: dict[str, bytes], type_: str = "Opaque") -> None:
    body = {
        "metadata": {"name": name},
        "type": type_,
        "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
    }
    try:
        ns.core.create_namespaced_secret(ns.name, body)
    except client.ApiException as e:
        if e.status != 409:
            raise
        ns.core.replace_namespaced_secret(name, ns.name, body)


def degraded(ns, name: str, reason: str) -> dict:
    c = ns.condition(name, "Degraded")
    return c if c.get("status") == "True" and c.get("reason") == reason else {}


def warning(ns, name: str, reason: str, words: str):
    return [e for e in ns.events(name) if e.type == "Warning" and e.reason == reason and words in e.message]


def hashes(ns, name: str) -> list[str]:
    return sorted(p.metadata.labels["spyre-serve.io/template-hash"] for p in ns.pods(name))


def self_signed() -> tuple[bytes, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes as h
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "model")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, h.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), pem_key


def assert_no_secret_value(operator, ns, names: list[str], values: list[str]) -> None:
    """No value in any pod's args (nor a plain env value), the models' status, the namespace's Events or
    the operator's log."""
    for pod in ns.core.list_namespaced_pod(ns.name).items:
        container = pod.spec.containers[0]
        texts = [*(container.args or []), *(e.value or "" for e in container.env or [])]
        texts.append(str(pod.metadata.annotations or {}))
        for value in values:
            assert not [t for t in texts if value in t], (pod.metadata.name, value)
    statuses = [str(ns.model(n).get("status")) for n in names]
    events = [f"{e.reason} {e.message}" for e in ns.core.list_namespaced_event(ns.name).items]
    log = operator.log_path.read_text(errors="replace")
    for value in values:
        encoded = base64.b64encode(value.encode()).decode()
        for where, texts in (("status", statuses), ("Event", events), ("log", [log])):
            assert not [t for t in texts if value in t or encoded in t], (where, value)


def test_api_key_secret_missing_then_keyless_then_sound_then_rotated(operator, ns):
    """A missing Secret, then a Secret without the key: a condition and a Warning naming them, no pod. The
    key arrives: pods with the key from the Secret. New data: the pods roll. No value anywhere."""
    ns.apply_model("keyed", spec(auth=api_key()))
    wait_for(lambda: degraded(ns, "keyed", "SecretNotFound"), what="SecretNotFound")
    cond = ns.condition("keyed", "Degraded")
    assert "Secret model-key (spec.auth.apiKey.secretRef) does not exist" in cond["message"]
    assert ns.condition("keyed", "Ready")["status"] == "False"
    wait_for(lambda: warning(ns, "keyed", "SecretNotFound", "model-key"), what="a Warning naming the Secret")
    assert ns.pods("keyed") == []

    put_secret(ns, "model-key", {"other": KEY_ONE.encode()})
    wait_for(lambda: degraded(ns, "keyed", "SecretKeyNotFound"), what="SecretKeyNotFound (the watch)")
    wait_for(lambda: warning(ns, "keyed", "SecretKeyNotFound", "has no key api-key"), what="its Warning")
    assert ns.pods("keyed") == []

    put_secret(ns, "model-key", {"api-key": KEY_ONE.encode()})
    ns.wait_ready("keyed", 1)
    (pod,) = ns.pods("keyed")
    env = {e.name: e for e in pod.spec.containers[0].env}
    ref = env["SPYRE_API_KEY"].value_from.secret_key_ref
    assert (ref.name, ref.key, env["SPYRE_API_KEY"].value) == ("model-key", "api-key", None)
    assert pod.spec.automount_service_account_token is False
    first = hashes(ns, "keyed")

    put_secret(ns, "model-key", {"api-key": KEY_TWO.encode()})
    wait_for(
        lambda: len(hashes(ns, "keyed")) == 1 and hashes(ns, "keyed") != first,
        timeout=60,
        what="the pods rolled to the new key",
    )
    ns.wait_ready("keyed", 1)
    assert ns.pods("keyed")[0].metadata.annotations["spyre-serve.io/secret-digest"]

    ns.core.delete_namespaced_secret("model-key", ns.name)

    def waiting_for_secret():
        c = ns.condition("keyed", "Progressing")
        return c.get("reason") == "WaitingForSecret" and "Secret model-key" in c["message"]

    # (the kubelet stand-in, as a kubelet would at a restart, also fails the pod: CreateContainerConfigError)
    wait_for(waiting_for_secret, what="the rollout waiting for the deleted Secret")
    assert len(ns.pods("keyed")) == 1  # no new pod is made, none removed
    assert_no_secret_value(operator, ns, ["keyed"], [KEY_ONE, KEY_TWO])


def test_token_authorization_identity_made_and_removed(operator, ns, kube):
    """The model's ServiceAccount and its auth-delegator binding (which the operator may make: it holds
    `bind` on that ClusterRole only), the pod running as it; the binding leaves when the model stops asking
    for it and when the model goes."""
    rbac = client.RbacAuthorizationV1Api(kube)
    binding = f"spyre-serve:{ns.name}:tokened:auth-delegator"
    ns.apply_model("tokened", spec(auth={"kubernetes": {}}))
    ns.wait_ready("tokened", 1)
    account = ns.core.read_namespaced_service_account("tokened-runtime", ns.name)
    assert account.metadata.owner_references[0].kind == "SpyreModel"
    crb = rbac.read_cluster_role_binding(binding)
    assert crb.role_ref.name == "system:auth-delegator"
    assert [(s.kind, s.name, s.namespace) for s in crb.subjects] == [
        ("ServiceAccount", "tokened-runtime", ns.name)
    ]
    (pod,) = ns.pods("tokened")
    assert pod.spec.service_account_name == "tokened-runtime" and pod.spec.automount_service_account_token
    env = {e.name: e for e in pod.spec.containers[0].env}
    assert env["SPYRE_AUTH"].value == "kubernetes" and env["SPYRE_AUTH_MODEL"].value == "tokened"
    assert env["SPYRE_AUTH_NAMESPACE"].value_from.field_ref.field_path == "metadata.namespace"

    def gone() -> bool:
        try:
            rbac.read_cluster_role_binding(binding)
        except client.ApiException as e:
            return e.status == 404
        return False

    ns.patch_spec("tokened", {"auth": None})
    wait_for(gone, timeout=30, what="the binding removed once the model stops asking for it")
    ns.wait_ready("tokened", 1, timeout=90)
    assert not ns.pods("tokened")[0].spec.automount_service_account_token
    ns.patch_spec("tokened", {"auth": {"kubernetes": {}}})
    wait_for(lambda: not gone(), timeout=30, what="the binding made again")
    ns.custom.delete_namespaced_custom_object("spyre-serve.io", "v1alpha1", ns.name, "spyremodels", "tokened")
    wait_for(gone, timeout=30, what="the binding removed with the model")


def test_tls_secret_missing_malformed_then_sound(operator, ns):
    """No Secret, then one that is no key pair: a condition and a Warning naming it, no pod. A sound key
    pair: the pod serves HTTPS only (every probe), the Service says https."""
    cert, key = self_signed()
    ns.apply_model("secure", spec(tls={"secretName": "model-tls"}))
    wait_for(lambda: degraded(ns, "secure", "SecretNotFound"), what="SecretNotFound")
    wait_for(lambda: warning(ns, "secure", "SecretNotFound", "model-tls"), what="a Warning naming it")
    put_secret(ns, "model-tls", {"tls.crt": b"not a certificate", "tls.key": key}, type_="kubernetes.io/tls")
    wait_for(lambda: degraded(ns, "secure", "SecretInvalid"), what="SecretInvalid")
    assert (
        "Secret model-tls (spec.tls.secretName): tls.crt is not a PEM certificate"
        in (ns.condition("secure", "Degraded")["message"])
    )
    assert ns.pods("secure") == []

    put_secret(ns, "model-tls", {"tls.crt": cert, "tls.key": key}, type_="kubernetes.io/tls")
    ns.wait_ready("secure", 1)
    (pod,) = ns.pods("secure")
    c = pod.spec.containers[0]
    for probe in (c.startup_probe, c.readiness_probe, c.liveness_probe):
        assert probe.http_get.scheme == "HTTPS"
    env = {e.name: e.value for e in c.env}
    assert env["SPYRE_SSL_CERTFILE"] == "/etc/spyre/tls/tls.crt"
    assert env["SPYRE_SSL_KEYFILE"] == "/etc/spyre/tls/tls.key"
    mount = next(m for m in c.volume_mounts if m.mount_path == "/etc/spyre/tls")
    assert mount.read_only
    volume = next(v for v in pod.spec.volumes if v.name == mount.name)
    assert volume.secret.secret_name == "model-tls"
    svc = ns.core.read_namespaced_service("secure", ns.name)
    assert svc.spec.ports[0].app_protocol == "https"
    key_body = key.decode().splitlines()[1]
    assert_no_secret_value(operator, ns, ["secure"], [key_body])
