"""Who may call a model, as built (no cluster): the serving pod for each spec.auth and spec.tls mode, the
Secrets' checks and digest in the template hash, token authorization's identity, the Service."""

from __future__ import annotations

import base64
import dataclasses

import pytest
from spyre_contract.auth import (
    API_KEY_ENV,
    AUTH_MODE_ENV,
    AUTH_MODEL_ENV,
    AUTH_NAMESPACE_ENV,
    TLS_CERTFILE_ENV,
    TLS_KEYFILE_ENV,
    TLS_MOUNT,
)
from spyre_operator.kinds.access import binding_name, build_identity, secret_problem
from spyre_operator.kinds.pods.template import (
    SECRET_DIGEST_ANNOTATION,
    build_pod,
    pod_template,
    template_hash,
)
from spyre_operator.kinds.service import SERVICE_CA_ANNOTATION, build_service, service_repair
from spyre_operator.settings import MODEL_LABEL, OperatorSettings
from spyre_operator.spec.model_spec import Tls

from tests.operator.objects import MODEL, spec_of

KEY = {"apiKey": {"secretRef": {"name": "granite-key", "key": "api-key"}}}
TLS = {"secretName": "granite-tls"}
PEM_CERT = b"-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIU\n-----END CERTIFICATE-----\n"
PEM_KEY = b"-----BEGIN EC PRIVATE KEY-----\nMHcCAQEEIBKx\n-----END EC PRIVATE KEY-----\n"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# mode -> (spec changes, env the runtime gets (None: from elsewhere), service account, token mounted, scheme)
MODES = {
    "open": ({}, {}, None, False, "HTTP"),
    "api-key": ({"auth": KEY}, {API_KEY_ENV: None}, None, False, "HTTP"),
    "kubernetes": (
        {"auth": {"kubernetes": {}}},
        {AUTH_MODE_ENV: "kubernetes", AUTH_MODEL_ENV: "granite", AUTH_NAMESPACE_ENV: None},
        "granite-runtime",
        True,
        "HTTP",
    ),
    "tls": (
        {"tls": TLS},
        {TLS_CERTFILE_ENV: f"{TLS_MOUNT}/tls.crt", TLS_KEYFILE_ENV: f"{TLS_MOUNT}/tls.key"},
        None,
        False,
        "HTTPS",
    ),
    "api-key-and-tls": (
        {"auth": KEY, "tls": TLS},
        {API_KEY_ENV: None, TLS_CERTFILE_ENV: None},
        None,
        False,
        "HTTPS",
    ),
}


@pytest.mark.parametrize("mode", MODES)
def test_serving_pod_of_each_mode(mode):
    changes, want_env, account, token, scheme = MODES[mode]
    pod = build_pod(MODEL, spec_of(**changes), OperatorSettings())
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    for name, value in want_env.items():
        assert name in env, (mode, name)
        if value is not None:
            assert env[name]["value"] == value
    for name in (API_KEY_ENV, AUTH_MODE_ENV, TLS_CERTFILE_ENV):
        assert (name in env) == (name in want_env), (mode, name)
    assert pod["spec"].get("serviceAccountName") == account
    assert pod["spec"]["automountServiceAccountToken"] is token  # no token unless the model checks tokens
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"].get("scheme", "HTTP") == scheme, (mode, probe)
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert (TLS_MOUNT in mounts) == ("tls" in changes)
    if "tls" in changes:
        assert mounts[TLS_MOUNT]["readOnly"] is True
        volume = {v["name"]: v for v in pod["spec"]["volumes"]}[mounts[TLS_MOUNT]["name"]]
        assert volume["secret"] == {"secretName": "granite-tls"}
    if API_KEY_ENV in want_env:  # from the Secret, never a value or an argument
        ref = env[API_KEY_ENV]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "granite-key", "key": "api-key"} and "value" not in env[API_KEY_ENV]
    if AUTH_NAMESPACE_ENV in want_env:
        assert env[AUTH_NAMESPACE_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert not any("key" in a.lower() or "token" in a.lower() for a in container["args"])


def test_new_secret_data_is_a_new_template_hash_and_annotation():
    spec = spec_of(auth=KEY)
    one, two = dataclasses.replace(spec, secret_digest="d1"), dataclasses.replace(spec, secret_digest="d2")
    s = OperatorSettings()
    assert pod_template("granite", one, s) == pod_template("granite", two, s)  # the spec is the same
    pods = [build_pod(MODEL, x, s) for x in (one, two)]
    assert (
        pods[0]["metadata"]["labels"]["spyre-serve.io/template-hash"]
        != pods[1]["metadata"]["labels"]["spyre-serve.io/template-hash"]
    )
    assert [p["metadata"]["annotations"][SECRET_DIGEST_ANNOTATION] for p in pods] == ["d1", "d2"]
    # models that read no Secret keep the hashes they had
    plain = pod_template("granite", spec_of(), s)
    assert template_hash(plain) == template_hash(plain, "")
    assert "annotations" not in build_pod(MODEL, spec_of(), s)["metadata"]


KEYS = ("api-key",)
TLS_KEYS = ("tls.crt", "tls.key")
# (Secret, keys read, reason or None) -> the problem names the Secret, the key and never the data
SECRETS = [
    ("missing", None, KEYS, "SecretNotFound", "Secret s (f) does not exist"),
    ("no-such-key", {"data": {"other": b64(b"hunter2")}}, KEYS, "SecretKeyNotFound", "has no key api-key"),
    ("no-data", {}, KEYS, "SecretKeyNotFound", "has no key api-key"),
    ("key-there", {"data": {"api-key": b64(b"hunter2")}}, KEYS, None, ""),
    ("tls-sound", {"data": {"tls.crt": b64(PEM_CERT), "tls.key": b64(PEM_KEY)}}, TLS_KEYS, None, ""),
    ("tls-no-key", {"data": {"tls.crt": b64(PEM_CERT)}}, TLS_KEYS, "SecretKeyNotFound", "has no key tls.key"),
    (
        "tls-not-pem",
        {"data": {"tls.crt": b64(b"hunter2-cert"), "tls.key": b64(PEM_KEY)}},
        TLS_KEYS,
        "SecretInvalid",
        "tls.crt is not a PEM certificate",
    ),
    (
        "tls-key-is-a-cert",
        {"data": {"tls.crt": b64(PEM_CERT), "tls.key": b64(PEM_CERT)}},
        TLS_KEYS,
        "SecretInvalid",
        "tls.key is not a PEM private key",
    ),
    (
        "tls-not-base64",
        {"data": {"tls.crt": "!!!", "tls.key": b64(PEM_KEY)}},
        TLS_KEYS,
        "SecretInvalid",
        "tls.crt is not a PEM certificate",
    ),
]


@pytest.mark.parametrize(("case", "secret", "keys", "reason", "words"), SECRETS, ids=[c[0] for c in SECRETS])
def test_secret_problems_name_the_secret_and_key_never_the_data(case, secret, keys, reason, words):
    problem = secret_problem("s", secret, keys, "f")
    if reason is None:
        assert problem is None
        return
    assert problem.reason == reason and words in problem.message and "Secret s (f)" in problem.message
    assert "hunter2" not in problem.message and not problem.is_stalled  # the Secret may yet come


def test_token_authorization_identity():
    account, binding = build_identity(MODEL)
    assert account["metadata"]["name"] == "granite-runtime"
    assert account["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert binding["kind"] == "ClusterRoleBinding" and "ownerReferences" not in binding["metadata"]
    assert "namespace" not in binding["metadata"]
    assert (
        binding["metadata"]["name"]
        == binding_name("ml", "granite")
        == "spyre-serve:ml:granite:auth-delegator"
    )
    assert binding["metadata"]["labels"][MODEL_LABEL] == "granite"
    assert binding["metadata"]["labels"]["spyre-serve.io/model-namespace"] == "ml"
    assert binding["roleRef"]["name"] == "system:auth-delegator"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "granite-runtime", "namespace": "ml"}]


def test_service_of_a_tls_model_says_https_and_asks_the_service_ca_on_openshift():
    plain = build_service(MODEL, OperatorSettings())
    assert plain["spec"]["ports"][0]["appProtocol"] is None and "annotations" not in plain["metadata"]
    tls = build_service(MODEL, OperatorSettings(), Tls("granite-tls"))
    assert tls["spec"]["ports"][0]["appProtocol"] == "https" and "annotations" not in tls["metadata"]
    openshift = build_service(MODEL, OperatorSettings(openshift_service_ca=True), Tls("granite-tls"))
    assert openshift["metadata"]["annotations"] == {SERVICE_CA_ANNOTATION: "granite-tls"}
    # TLS turned on, then off: the port's appProtocol follows (None removes it), the annotation is added
    assert service_repair(plain, plain) is None
    assert service_repair(plain, tls)["spec"]["ports"][0]["appProtocol"] == "https"
    assert service_repair(tls, plain)["spec"]["ports"][0]["appProtocol"] is None
    assert service_repair(tls, openshift) == {
        "metadata": {"annotations": {SERVICE_CA_ANNOTATION: "granite-tls"}}
    }


class _NoSecrets:
    """Kube's read as the API server answers it for a Secret that does not exist (yet)."""

    def read(self, kind, name, namespace):
        assert kind == "Secret"
        return None


@pytest.mark.parametrize(
    ("service_ca", "reason", "problem"),
    [(False, "WaitingForSecret", "SecretNotFound"), (True, "WaitingForSecret", None)],
)
def test_a_missing_key_pair_is_a_problem_unless_the_service_ca_writes_it(service_ca, reason, problem):
    from spyre_operator.io.work import Pass
    from spyre_operator.kinds.access import AccessStep

    work = Pass()
    step = AccessStep(OperatorSettings(openshift_service_ca=service_ca), _NoSecrets())
    assert step.ensure(MODEL, spec_of(tls=TLS), work) is None  # the pods wait
    assert work.waiting_reason == reason and "granite-tls" in work.waiting
    assert [p.reason for p in work.problems] == ([problem] if problem else [])
    if service_ca:
        assert "service CA" in work.waiting
    assert step.secret_changed("ml", "granite-tls") == [("ml", "granite")]  # its watch event brings it back
    assert step.secret_changed("ml", "other") == []
