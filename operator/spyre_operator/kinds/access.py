"""Who may call a model (spec.auth, spec.tls; issue 40), the operator's half: the Secrets the pods read and
the identity token authorization needs.

- The API key's Secret and the TLS key pair's Secret are read (never logged, never in a status or an
  Event: only their names and keys are), checked (the key is there; tls.crt and tls.key are PEM) and
  digested: the digest goes into the pod template, so new data rolls the pods. A Secret missing or malformed
  is a problem naming it, and the pods wait (no pod that cannot start, no crash loop); its watch event
  brings the model back.
- `auth.kubernetes`: a ServiceAccount per model (owned) and a ClusterRoleBinding of it to
  `system:auth-delegator` (TokenReviews and SubjectAccessReviews). A cluster-scoped object cannot be owned
  by a namespaced one: the binding carries the model's labels, and is removed when the model goes (its
  DELETED event, or the watch listing a binding whose model is gone) or stops asking for it."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import logging
import re
import threading

from kubernetes.client.rest import ApiException
from spyre_contract.auth import TLS_CERT_KEY, TLS_KEY_KEY

from spyre_operator.io.kube import Kube, api_message, problem_of
from spyre_operator.io.watch import Key
from spyre_operator.io.work import Pass, Problem
from spyre_operator.kinds.ownership import owner_reference, selector_labels
from spyre_operator.settings import MANAGED_BY, OperatorSettings
from spyre_operator.spec.model_spec import ModelSpec

log = logging.getLogger(__name__)

AUTH_DELEGATOR = "system:auth-delegator"
NAMESPACE_LABEL = "spyre-serve.io/model-namespace"
_PEM = {
    TLS_CERT_KEY: re.compile(rb"-----BEGIN CERTIFICATE-----\s+[A-Za-z0-9+/=\s]+-----END CERTIFICATE-----"),
    TLS_KEY_KEY: re.compile(
        rb"-----BEGIN ([A-Z]+ )?PRIVATE KEY-----\s+[A-Za-z0-9+/=\s]+-----END ([A-Z]+ )?PRIVATE KEY-----"
    ),
}


def account_name(model_name: str) -> str:
    """The model's own ServiceAccount (token authorization only)."""
    return f"{model_name}-runtime"


def binding_name(namespace: str, model_name: str) -> str:
    return f"spyre-serve:{namespace}:{model_name}:auth-delegator"


class AccessStep:
    def __init__(self, settings: OperatorSettings, kube: Kube) -> None:
        self.settings = settings
        self.kube = kube
        self._lock = threading.Lock()
        self._users: dict[tuple[str, str], set[Key]] = {}  # (namespace, Secret) -> the models reading it
        self._digests: dict[Key, tuple[tuple, str]] = {}  # key -> ((uid, generation), digest): read and sound
        self._identity: dict[Key, tuple] = {}  # key -> (uid, generation) whose SA and binding are as wanted
        self._bindings: set[Key] = set()  # models the watch has seen a binding of

    def ensure(self, model: dict, spec: ModelSpec, work: Pass) -> ModelSpec | None:
        """The spec with its Secrets' digest, once the model's identity is made and its Secrets are sound;
        None while the pods must wait (then a problem, or what they wait for, in `work`)."""
        meta = model["metadata"]
        key, stamp = (meta["namespace"], meta["name"]), (meta["uid"], meta.get("generation"))
        try:
            if self._identity.get(key) != stamp:
                self._ensure_identity(model, spec)
                self._identity[key] = stamp
        except ApiException as e:
            work.problems.append(problem_of("AuthDelegation", e))
            return None
        names = secret_names(spec)
        with self._lock:
            for users in self._users.values():
                users.discard(key)
            for name in names:
                self._users.setdefault((key[0], name), set()).add(key)
            seen = self._digests.get(key)
        if not names:
            return spec
        if seen is not None and seen[0] == stamp:
            return _with_digest(spec, seen[1])
        digest = self._read_secrets(key[0], spec, work)
        if digest is None:
            return None
        with self._lock:
            self._digests[key] = (stamp, digest)
        return _with_digest(spec, digest)

    def _read_secrets(self, namespace: str, spec: ModelSpec, work: Pass) -> str | None:
        found = []
        for name, keys, field_path in _wanted(spec):
            try:
                secret = self.kube.read("Secret", name, namespace)
            except ApiException as e:
                work.problems.append(problem_of("Secret", e))
                return None
            is_service_ca = spec.tls and name == spec.tls.secret_name and self.settings.openshift_service_ca
            if secret is None and is_service_ca:
                work.waiting_reason = "WaitingForSecret"
                work.waiting = f"the pods wait for the service CA to write Secret {name} ({field_path})"
                return None
            if problem := secret_problem(name, secret, keys, field_path):
                work.problems.append(problem)
                work.waiting_reason = "WaitingForSecret"
                work.waiting = problem.message
                return None
            found += [(name, k, secret["data"][k]) for k in keys]
        return hashlib.sha256(repr(found).encode()).hexdigest()[:16]

    def _ensure_identity(self, model: dict, spec: ModelSpec) -> None:
        key = (model["metadata"]["namespace"], model["metadata"]["name"])
        if spec.auth.kubernetes:
            for body in build_identity(model):
                self.kube.create_unless_exists(body)
            with self._lock:
                self._bindings.add(key)
        elif self.has_binding(key):
            self.remove_binding(key)

    # ---- what the watches report ---------------------------------------------------------------------

    def secret_changed(self, namespace: str, name: str) -> list[Key]:
        """The models reading this Secret, their digests forgotten: enqueue them."""
        with self._lock:
            keys = sorted(self._users.get((namespace, name), ()))
            for key in keys:
                self._digests.pop(key, None)
            return keys

    def binding_seen(self, key: Key) -> bool:
        """Notes that the watch saw the model's binding; True when that is news."""
        with self._lock:
            is_new = key not in self._bindings
            self._bindings.add(key)
            return is_new

    def has_binding(self, key: Key) -> bool:
        with self._lock:
            return key in self._bindings

    def remove_binding(self, key: Key) -> None:
        """Deletes the model's ClusterRoleBinding (gone already: no error)."""
        try:
            self.kube.rbac.delete_cluster_role_binding(
                binding_name(*key), _request_timeout=self.kube.timeout, _preload_content=False
            )
        except ApiException as e:
            if e.status != 404:
                raise
        with self._lock:
            self._bindings.discard(key)

    def forget(self, key: Key) -> None:
        """The model is gone (no I/O: the watch's handler calls it); `release` removes its binding."""
        with self._lock:
            for users in self._users.values():
                users.discard(key)
            self._digests.pop(key, None)
            self._identity.pop(key, None)

    def release(self, key: Key) -> None:
        """The model is gone: its ClusterRoleBinding too. A failure is logged and retried when the watch
        lists the binding again (at the operator's next start at the latest)."""
        if not self.has_binding(key):
            return
        try:
            self.remove_binding(key)
        except ApiException as e:
            log.warning("removing ClusterRoleBinding %s: %s", binding_name(*key), api_message(e))


def _with_digest(spec: ModelSpec, digest: str) -> ModelSpec:
    return dataclasses.replace(spec, secret_digest=digest)


def secret_names(spec: ModelSpec) -> list[str]:
    return [name for name, _, _ in _wanted(spec)]


def _wanted(spec: ModelSpec) -> list[tuple[str, tuple[str, ...], str]]:
    """(Secret, its keys the pods read, the field naming it)."""
    wanted = []
    if spec.auth.api_key:
        ref = spec.auth.api_key
        wanted.append((ref.secret_name, (ref.key,), "spec.auth.apiKey.secretRef"))
    if spec.tls:
        wanted.append((spec.tls.secret_name, (TLS_CERT_KEY, TLS_KEY_KEY), "spec.tls.secretName"))
    return wanted


def secret_problem(name: str, secret: dict | None, keys: tuple[str, ...], field_path: str) -> Problem | None:
    """What is wrong with a Secret the pods read, naming it and its key, never its data; None: sound."""
    if secret is None:
        return Problem("SecretNotFound", f"Secret {name} ({field_path}) does not exist", is_stalled=False)
    data = secret.get("data") or {}
    for key in keys:
        if key not in data:
            return Problem(
                "SecretKeyNotFound", f"Secret {name} ({field_path}) has no key {key}", is_stalled=False
            )
        if key in _PEM:
            try:
                value = base64.b64decode(data[key], validate=True)
            except (binascii.Error, ValueError):
                value = b""
            if not _PEM[key].search(value):
                what = "a PEM certificate" if key == TLS_CERT_KEY else "a PEM private key"
                return Problem(
                    "SecretInvalid", f"Secret {name} ({field_path}): {key} is not {what}", is_stalled=False
                )
    return None


def build_identity(model: dict) -> list[dict]:
    """The model's ServiceAccount (owned) and its ClusterRoleBinding to system:auth-delegator (labelled with
    the model's name and namespace: no owner reference can cross scopes)."""
    meta = model["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    rbac = "rbac.authorization.k8s.io"
    labels = {**selector_labels(name), **MANAGED_BY}
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {
                "name": account_name(name),
                "namespace": namespace,
                "labels": labels,
                "ownerReferences": [owner_reference(model)],
            },
        },
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {
                "name": binding_name(namespace, name),
                "labels": {**labels, NAMESPACE_LABEL: namespace},
            },
            "roleRef": {"apiGroup": rbac, "kind": "ClusterRole", "name": AUTH_DELEGATOR},
            "subjects": [{"kind": "ServiceAccount", "name": account_name(name), "namespace": namespace}],
        },
    ]
