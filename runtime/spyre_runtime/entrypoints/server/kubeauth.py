"""Token authorization as OpenShift AI's single-model serving does it (issue 40): a caller presents a
Kubernetes token (`Authorization: Bearer TOKEN`, a ServiceAccount's or a user's); a TokenReview says who it
is, then a SubjectAccessReview whether that user may `get` this SpyreModel, by name, in its namespace. So
access is an ordinary Role and RoleBinding.

Answers (allowed and denied) are cached per token (by its digest) for `cache_seconds`; concurrent requests
with one token share one review. Off the engine's path: the reviews are awaited on the event loop, never on
the engine's thread. Fail closed: an API server that does not answer, or answers with an error, gives 503,
never a pass (and the 503 is not cached)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from fastapi.responses import JSONResponse
from spyre_contract.auth import AUTH_GROUP, AUTH_RESOURCE, AUTH_VERB
from starlette.datastructures import Headers

from spyre_runtime.config import ConfigError
from spyre_runtime.entrypoints.server.auth import bearer_token, forbidden, unauthenticated, undecided

log = logging.getLogger(__name__)
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
REVIEW_TIMEOUT_SECONDS = 5.0  # a frozen API server: 503 after this, not a hung request
MAX_CACHED_TOKENS = 10_000  # garbage tokens cannot grow the cache without bound
WARN_EVERY_SECONDS = 10.0


@dataclass(frozen=True)
class ApiServer:
    """How the runtime reaches the API server, as its own identity (the pod's ServiceAccount)."""

    host: str
    ca_file: str | None
    verify: bool
    cert_file: str | None
    key_file: str | None
    authorization: Callable[[], str | None]  # its own Authorization header, re-read (bound tokens rotate)
    source: str  # where this came from, for the log


def api_server_from(environ, sa_dir: Path = SERVICE_ACCOUNT_DIR) -> ApiServer:
    """In a pod (KUBERNETES_SERVICE_HOST): the in-cluster ServiceAccount; else KUBECONFIG or ~/.kube/config.
    Raises ConfigError (one line) when there is neither."""
    from kubernetes import client, config
    from kubernetes.config.incluster_config import InClusterConfigLoader

    c = client.Configuration()
    kubeconfig = environ.get("KUBECONFIG") or None
    try:
        if kubeconfig is None and environ.get("KUBERNETES_SERVICE_HOST"):
            loader = InClusterConfigLoader(str(sa_dir / "token"), str(sa_dir / "ca.crt"), environ=environ)
            loader.load_and_set(c)
            source = f"in-cluster ServiceAccount ({sa_dir})"
        else:
            path = kubeconfig or str(Path("~/.kube/config").expanduser())
            config.load_kube_config(config_file=path, client_configuration=c, persist_config=False)
            source = f"kubeconfig {path}"
    except (config.ConfigException, OSError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(
            "SPYRE_AUTH=kubernetes cannot reach the API server: not in a pod (KUBERNETES_SERVICE_HOST) "
            f"and no usable kubeconfig (KUBECONFIG): {e}"
        ) from None
    return ApiServer(
        host=c.host.rstrip("/"),
        ca_file=c.ssl_ca_cert,
        verify=bool(c.verify_ssl),
        cert_file=c.cert_file,
        key_file=c.key_file,
        authorization=lambda: c.auth_settings().get("BearerToken", {}).get("value"),
        source=source,
    )


class Undecided(Exception):
    """The API server gave no answer to go by."""


@dataclass(frozen=True)
class Verdict:
    status: int  # 200 allowed, 401, 403
    message: str

    def response(self) -> JSONResponse | None:
        if self.status == 200:
            return None
        if self.status == 401:
            return unauthenticated(self.message, "invalid_token")
        return forbidden(self.message)


class TokenAuth:
    """The authorizer of `SPYRE_AUTH=kubernetes` (see the module's docstring)."""

    def __init__(self, api: ApiServer, model: str, namespace: str, cache_seconds: float) -> None:
        self.api, self.model, self.namespace, self.cache_seconds = api, model, namespace, cache_seconds
        self._cache: dict[bytes, tuple[float, Verdict]] = {}
        self._pending: dict[bytes, asyncio.Task] = {}
        self._client: httpx.AsyncClient | None = None
        self._last_warning = 0.0
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per review

    def describe(self) -> str:
        return (
            f"Kubernetes tokens: {AUTH_VERB} {AUTH_RESOURCE}.{AUTH_GROUP} {self.model!r} in namespace "
            f"{self.namespace!r} (API server {self.api.host} by {self.api.source}; answers cached "
            f"{self.cache_seconds:g} s)"
        )

    async def refusal(self, headers: Headers) -> JSONResponse | None:
        token = bearer_token(headers)
        if token is None:
            return unauthenticated("missing bearer token (Authorization: Bearer TOKEN)", "invalid_token")
        key = hashlib.sha256(token.encode()).digest()
        cached = self._cache.get(key)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1].response()
        task = self._pending.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._review(key, token))
            self._pending[key] = task
        try:
            verdict = await asyncio.shield(task)  # a caller that goes away does not cancel the others' review
        except Undecided as e:
            self._warn(str(e))
            return undecided(f"cannot check the token now: {e}")
        return verdict.response()

    async def _review(self, key: bytes, token: str) -> Verdict:
        try:
            verdict = await self._decide(token)
        finally:
            self._pending.pop(key, None)
        self._remember(key, verdict)
        return verdict

    async def _decide(self, token: str) -> Verdict:
        review = await self._post(
            "/apis/authentication.k8s.io/v1/tokenreviews",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}},
        )
        status = review.get("status") or {}
        if not status.get("authenticated"):
            return Verdict(401, "invalid bearer token: the API server does not authenticate it")
        user = status.get("user") or {}
        name = user.get("username", "")
        spec = {
            "user": name,
            "uid": user.get("uid", ""),
            "groups": user.get("groups") or [],
            "extra": user.get("extra") or {},
            "resourceAttributes": {
                "group": AUTH_GROUP,
                "resource": AUTH_RESOURCE,
                "verb": AUTH_VERB,
                "name": self.model,
                "namespace": self.namespace,
            },
        }
        sar = await self._post(
            "/apis/authorization.k8s.io/v1/subjectaccessreviews",
            {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec},
        )
        if (sar.get("status") or {}).get("allowed"):
            return Verdict(200, "")
        return Verdict(
            403,
            f"{name} may not {AUTH_VERB} {AUTH_RESOURCE}.{AUTH_GROUP} {self.model!r} in namespace "
            f"{self.namespace!r}",
        )

    async def _post(self, path: str, body: dict) -> dict:
        kind = body["kind"]
        headers = {"accept": "application/json"}
        own = self.api.authorization()
        if own:
            headers["authorization"] = own
        try:
            res = await self._http().post(self.api.host + path, json=body, headers=headers)
        except httpx.HTTPError as e:
            raise Undecided(f"the API server did not answer a {kind} ({type(e).__name__})") from None
        if res.status_code >= 300:
            raise Undecided(f"the API server answered {kind} with {res.status_code}: {_message(res)}")
        try:
            return res.json()
        except ValueError:
            raise Undecided(f"the API server answered {kind} with something other than JSON") from None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            verify: ssl.SSLContext | bool = False
            if self.api.verify:
                verify = ssl.create_default_context(cafile=self.api.ca_file)
                if self.api.cert_file:
                    verify.load_cert_chain(self.api.cert_file, self.api.key_file)
            self._client = httpx.AsyncClient(verify=verify, timeout=REVIEW_TIMEOUT_SECONDS)
        return self._client

    def _remember(self, key: bytes, verdict: Verdict) -> None:
        if self.cache_seconds <= 0:
            return
        now = time.monotonic()
        if len(self._cache) >= MAX_CACHED_TOKENS:
            self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
            while len(self._cache) >= MAX_CACHED_TOKENS:
                del self._cache[next(iter(self._cache))]  # the oldest
        self._cache[key] = (now + self.cache_seconds, verdict)

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warning >= WARN_EVERY_SECONDS:
            self._last_warning = now
            log.warning("token authorization failed closed (503): %s", message)


def _message(res: httpx.Response) -> str:
    try:
        return str(res.json().get("message", ""))[:300]
    except ValueError:
        return res.text[:300]
