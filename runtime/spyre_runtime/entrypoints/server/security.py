"""Who may call the server and how it is reached: the API key, Kubernetes token authorization and TLS, from
the flags and the environment (the names are spyre_contract.auth's). Read once, before anything loads: a
bad setting is one line naming the flag or variable (ConfigError, exit 2). Light at import: the CLI adds
the flags with it.

- API key: `--api-key`, else `SPYRE_API_KEY`, else `VLLM_API_KEY` (as vLLM reads it).
- `--auth kubernetes` or `SPYRE_AUTH=kubernetes`: kubeauth.py, for `SPYRE_AUTH_MODEL` in
  `SPYRE_AUTH_NAMESPACE`. A key and token authorization together are refused: a request would pass with
  either, and a key shared by every caller would undo the per-caller RoleBindings.
- TLS: `--ssl-certfile` and `--ssl-keyfile` (`SPYRE_SSL_CERTFILE`, `SPYRE_SSL_KEYFILE`), optionally
  `--ssl-ca-certs` (`SPYRE_SSL_CA_CERTS`): uvicorn serves HTTPS only."""

from __future__ import annotations

import argparse
import logging
import ssl
from dataclasses import dataclass

from spyre_contract import auth as names

from spyre_runtime.config import ConfigError

log = logging.getLogger(__name__)
CERT = f"--ssl-certfile ({names.TLS_CERTFILE_ENV})"
KEY = f"--ssl-keyfile ({names.TLS_KEYFILE_ENV})"
CA = f"--ssl-ca-certs ({names.TLS_CA_CERTS_ENV})"


def add_security_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every endpoint but /health, /metrics and /version "
        f"(default: ${names.API_KEY_ENV}, else ${names.API_KEY_ENV_ALIASES[0]}, else no key); the "
        "variables keep the key out of the process's arguments",
    )
    p.add_argument(
        "--auth",
        default=None,
        choices=names.AUTH_MODES,
        help=f"kubernetes: callers present a Kubernetes token that may get the SpyreModel "
        f"${names.AUTH_MODEL_ENV} in ${names.AUTH_NAMESPACE_ENV} (default: ${names.AUTH_MODE_ENV})",
    )
    p.add_argument("--ssl-certfile", default=None, help=f"serve HTTPS (default: ${names.TLS_CERTFILE_ENV})")
    p.add_argument("--ssl-keyfile", default=None, help=f"its private key (default: ${names.TLS_KEYFILE_ENV})")
    p.add_argument("--ssl-ca-certs", default=None, help=f"CA bundle (default: ${names.TLS_CA_CERTS_ENV})")


@dataclass(frozen=True)
class TokenSettings:
    model: str
    namespace: str
    cache_seconds: float


@dataclass(frozen=True)
class Security:
    api_key: str | None = None
    kubernetes: TokenSettings | None = None
    certfile: str | None = None
    keyfile: str | None = None
    ca_certs: str | None = None

    def uvicorn_ssl(self) -> dict:
        """uvicorn.Config's TLS arguments (none: plain HTTP)."""
        if self.certfile is None:
            return {}
        return {"ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile, "ssl_ca_certs": self.ca_certs}

    def authorizer(self, environ):
        """The guard's authorizer (None: open). Token authorization loads how to reach the API server here:
        none found is a ConfigError."""
        from spyre_runtime.entrypoints.server.auth import ApiKeyAuth

        if self.kubernetes is not None:
            from spyre_runtime.entrypoints.server.kubeauth import TokenAuth, api_server_from

            k = self.kubernetes
            return TokenAuth(api_server_from(environ), k.model, k.namespace, k.cache_seconds)
        return ApiKeyAuth(self.api_key) if self.api_key else None


def security_from(args, environ) -> Security:
    api_key = _api_key(args, environ)
    mode = args.auth or environ.get(names.AUTH_MODE_ENV, "").strip() or None
    kubernetes = None
    if mode is not None:
        if mode not in names.AUTH_MODES:
            raise ConfigError(
                f"{names.AUTH_MODE_ENV}={mode!r} is not an authorization mode (use "
                f"{', '.join(names.AUTH_MODES)}, or leave it unset)"
            )
        if api_key:
            raise ConfigError(
                f"token authorization ({names.AUTH_MODE_ENV}={mode}) and an API key (--api-key, "
                f"{names.API_KEY_ENV} or {names.API_KEY_ENV_ALIASES[0]}) cannot be used together; set one"
            )
        kubernetes = TokenSettings(
            _required(environ, names.AUTH_MODEL_ENV),
            _required(environ, names.AUTH_NAMESPACE_ENV),
            _cache_seconds(environ),
        )
    certfile = args.ssl_certfile or environ.get(names.TLS_CERTFILE_ENV) or None
    keyfile = args.ssl_keyfile or environ.get(names.TLS_KEYFILE_ENV) or None
    ca_certs = args.ssl_ca_certs or environ.get(names.TLS_CA_CERTS_ENV) or None
    check_tls(certfile, keyfile, ca_certs)
    return Security(api_key, kubernetes, certfile, keyfile, ca_certs)


def _api_key(args, environ) -> str | None:
    if args.api_key:
        log.warning(
            "--api-key puts the key in the process's arguments, which every user of the host can read; "
            "prefer %s",
            names.API_KEY_ENV,
        )
        return args.api_key
    for name in (names.API_KEY_ENV, *names.API_KEY_ENV_ALIASES):
        if environ.get(name):
            return environ[name]
    return None


def _required(environ, name: str) -> str:
    value = environ.get(name, "").strip()
    if not value:
        raise ConfigError(
            f"{name} is not set: token authorization needs it (the SpyreModel's name and namespace)"
        )
    return value


def _cache_seconds(environ) -> float:
    text = environ.get(names.AUTH_CACHE_SECONDS_ENV, "").strip()
    if not text:
        return names.AUTH_CACHE_SECONDS_DEFAULT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ConfigError(f"{names.AUTH_CACHE_SECONDS_ENV}={text!r}: expected seconds, a number >= 0")
    return value


def check_tls(certfile: str | None, keyfile: str | None, ca_certs: str | None) -> None:
    """The certificate, its key and the CA bundle load, as uvicorn will load them; else one line."""
    if bool(certfile) != bool(keyfile):
        given, missing = (CERT, KEY) if certfile else (KEY, CERT)
        raise ConfigError(f"{given} needs {missing}")
    if ca_certs and not certfile:
        raise ConfigError(f"{CA} needs {CERT} and {KEY}")
    if not certfile:
        return
    _readable(CERT, certfile, b"-----BEGIN CERTIFICATE-----", "a PEM certificate")
    _readable(KEY, keyfile, b"PRIVATE KEY-----", "a PEM private key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile)
    except ssl.SSLError as e:
        why = "the key does not match the certificate" if e.reason == "KEY_VALUES_MISMATCH" else str(e)
        raise ConfigError(f"{CERT} {certfile} and {KEY} {keyfile}: {why}") from None
    if ca_certs:
        _readable(CA, ca_certs, b"-----BEGIN CERTIFICATE-----", "PEM certificates")
        try:
            context.load_verify_locations(ca_certs)
        except ssl.SSLError as e:
            raise ConfigError(f"{CA} {ca_certs}: not a CA bundle ({e})") from None


def _readable(flag: str, path: str, marker: bytes, what: str) -> None:
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot be read ({e.strerror or e})") from None
    if marker not in data:
        raise ConfigError(f"{flag} {path}: not {what}")
