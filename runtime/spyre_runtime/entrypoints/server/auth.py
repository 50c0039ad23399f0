"""Who may call the model, as the guard (guard.py) asks it on every route but the open ones: the answers an
authorizer gives (OpenAI-style 401, 403 and 503 bodies) and the API key's authorizer. The Kubernetes token
authorizer is kubeauth.py's; security.py picks one from the flags and the environment."""

from __future__ import annotations

import hashlib
import secrets
from typing import Protocol

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from spyre_runtime.entrypoints.server.errors import error_body


class Authorizer(Protocol):
    def describe(self) -> str:
        """What is checked, for the start-up log (never a secret)."""

    async def refusal(self, headers: Headers) -> JSONResponse | None:
        """None: the caller may go on; else the answer it gets instead."""


def bearer_token(headers: Headers) -> str | None:
    """The token of `Authorization: Bearer TOKEN` (the scheme in any case), or None."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def unauthenticated(message: str, code: str) -> JSONResponse:
    """401: no credentials, or ones nobody vouches for."""
    return JSONResponse(
        error_body(message, "authentication_error", code=code),
        status_code=401,
        headers={"www-authenticate": "Bearer"},
    )


def forbidden(message: str) -> JSONResponse:
    """403: the caller is known and may not use this model."""
    return JSONResponse(error_body(message, "permission_error", code="forbidden"), status_code=403)


def undecided(message: str) -> JSONResponse:
    """503: whether the caller may go on cannot be decided now (fail closed)."""
    return JSONResponse(
        error_body(message, "service_unavailable", code="authorization_unavailable"), status_code=503
    )


class ApiKeyAuth:
    """`Authorization: Bearer KEY`, compared in constant time (over digests: the length leaks nothing)."""

    def __init__(self, key: str) -> None:
        self._digest = hashlib.sha256(key.encode()).digest()

    def describe(self) -> str:
        return "an API key"

    async def refusal(self, headers: Headers) -> JSONResponse | None:
        token = bearer_token(headers) or ""
        if secrets.compare_digest(hashlib.sha256(token.encode()).digest(), self._digest):
            return None
        return unauthenticated("invalid or missing API key", "invalid_api_key")
