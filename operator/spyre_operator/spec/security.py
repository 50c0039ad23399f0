"""spec.auth and spec.tls, validated (issue 40): who may call the model and whether it serves HTTPS. The CRD
states the same rules in CEL; the 1.20 API server ignores them, so the operator checks each one here and its
refusal names the field."""

from __future__ import annotations

import re

from spyre_contract.auth import (
    API_KEY_ENV,
    API_KEY_ENV_ALIASES,
    AUTH_CACHE_SECONDS_ENV,
    AUTH_MODE_ENV,
    AUTH_MODEL_ENV,
    AUTH_NAMESPACE_ENV,
    TLS_CA_CERTS_ENV,
    TLS_CERTFILE_ENV,
    TLS_KEYFILE_ENV,
)

from spyre_operator.spec.model_spec import ApiKey, Auth, InvalidSpec, Tls
from spyre_operator.spec.pod_fields import DNS_NAME

SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")  # a Secret's data key
# what spec.auth and spec.tls set on the runtime: spec.env may not set them too (it would win, or leak a key)
AUTH_ENV = (API_KEY_ENV, *API_KEY_ENV_ALIASES, AUTH_MODE_ENV, AUTH_MODEL_ENV, AUTH_NAMESPACE_ENV)
TLS_ENV = (TLS_CERTFILE_ENV, TLS_KEYFILE_ENV, TLS_CA_CERTS_ENV)
_ = AUTH_CACHE_SECONDS_ENV  # left to spec.env: how long the runtime keeps an answer


def parse_security(spec: dict, env: tuple) -> dict:
    """{"auth": Auth, "tls": Tls | None} of spec.auth and spec.tls; `env` is spec.env, parsed."""
    auth, tls = _auth(spec.get("auth")), _tls(spec.get("tls"))
    names = {v["name"] for v in env}
    for is_set, field_name, owned in ((auth != Auth(), "auth", AUTH_ENV), (tls is not None, "tls", TLS_ENV)):
        clash = sorted(names & set(owned)) if is_set else []
        if clash:
            raise InvalidSpec("env", f"{clash[0]} is set by spec.{field_name}: remove it from spec.env")
    return {"auth": auth, "tls": tls}


def _auth(value) -> Auth:
    if value is None:
        return Auth()
    if not isinstance(value, dict) or set(value) - {"apiKey", "kubernetes"}:
        raise InvalidSpec("auth", f"must be an object with apiKey or kubernetes, got {value!r}")
    if value.get("apiKey") is not None and value.get("kubernetes") is not None:
        raise InvalidSpec("auth", "apiKey and kubernetes exclude each other: choose one")
    kubernetes = value.get("kubernetes")
    if kubernetes is not None and kubernetes != {}:
        raise InvalidSpec("auth.kubernetes", f"takes no fields (write kubernetes: {{}}), got {kubernetes!r}")
    api_key = value.get("apiKey")
    if api_key is None:
        return Auth(kubernetes=kubernetes is not None)
    ref = api_key.get("secretRef") if isinstance(api_key, dict) else None
    if not isinstance(ref, dict):
        raise InvalidSpec("auth.apiKey.secretRef", "is required: the Secret's name and key holding the key")
    name, key = ref.get("name"), ref.get("key")
    if not isinstance(name, str) or len(name) > 253 or not DNS_NAME.match(name):
        raise InvalidSpec("auth.apiKey.secretRef.name", f"must be a Secret's name (a DNS name), got {name!r}")
    if not isinstance(key, str) or len(key) > 253 or not SECRET_KEY.match(key):
        raise InvalidSpec(
            "auth.apiKey.secretRef.key", f"must be a Secret key (letters, digits, '-', '_', '.'), got {key!r}"
        )
    return Auth(api_key=ApiKey(name, key))


def _tls(value) -> Tls | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"secretName"}:
        raise InvalidSpec("tls", f"must be an object with secretName, got {value!r}")
    name = value.get("secretName")
    if not isinstance(name, str) or len(name) > 253 or not DNS_NAME.match(name):
        raise InvalidSpec("tls.secretName", f"must be a Secret's name (a DNS name), got {name!r}")
    return Tls(name)
