"""Token authorization on a real control plane (issue 40), as OpenShift AI's single-model serving does it:
the runtime (as its own ServiceAccount, bound to system:auth-delegator) checks each caller's ServiceAccount
token with a TokenReview and a SubjectAccessReview for `get` on its SpyreModel. A RoleBinding gives access
(200 with the official client), no binding is 403, a garbage token 401, a revoked binding 403 once the cache
time has passed, and a stopped or frozen API server 503 (never 200), then 200 again once it is back.

The module has a control plane of its own (it stops the API server), and one server of the tiny model."""

import asyncio
import time

import httpx
import openai
import pytest
from kubernetes import client
from spyre_runtime.entrypoints.server.kubeauth import TokenAuth, api_server_from
from starlette.datastructures import Headers

from tests.cluster.controlplane import ControlPlane, kubeconfig_yaml
from tests.conftest import ensure_k8s_binaries, wait_for
from tests.httpclient import HTTP
from tests.runtime.serverproc import ServerProcess

NS, MODEL, CACHE_SECONDS = "models", "granite", 1.0
ENV = {
    "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager",
    "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "64",
    "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": "8",
    "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "1",
}


@pytest.fixture(scope="module")
def cp(tmp_path_factory):
    ensure_k8s_binaries()
    with ControlPlane(workdir=tmp_path_factory.mktemp("auth-cp")) as cp:
        yield cp


@pytest.fixture(scope="module")
def api(cp):
    return cp.api_client()


def token_of(api, name: str) -> str:
    """A ServiceAccount `name` in NS and a token for it from the TokenRequest API."""
    core = client.CoreV1Api(api)
    core.create_namespaced_service_account(NS, {"metadata": {"name": name}})
    body = {"spec": {"expirationSeconds": 3600}}
    return core.create_namespaced_service_account_token(name, NS, body).status.token


def bind(api, sa: str) -> str:
    """A Role granting `get` on spyremodels/MODEL and a RoleBinding of it to `sa`; returns its name."""
    rbac = client.RbacAuthorizationV1Api(api)
    role = {
        "metadata": {"name": f"use-{MODEL}"},
        "rules": [
            {
                "apiGroups": ["spyre-serve.io"],
                "resources": ["spyremodels"],
                "resourceNames": [MODEL],
                "verbs": ["get"],
            }
        ],
    }
    if not rbac.list_namespaced_role(NS, field_selector=f"metadata.name=use-{MODEL}").items:
        rbac.create_namespaced_role(NS, role)
    binding = {
        "metadata": {"name": f"{sa}-uses-{MODEL}"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"use-{MODEL}"},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": NS}],
    }
    rbac.create_namespaced_role_binding(NS, binding)
    return binding["metadata"]["name"]


@pytest.fixture(scope="module")
def tokens(api):
    client.CoreV1Api(api).create_namespace({"metadata": {"name": NS}})
    runtime = token_of(api, "runtime")
    client.RbacAuthorizationV1Api(api).create_cluster_role_binding(
        {
            "metadata": {"name": "runtime-auth-delegator"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "system:auth-delegator",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "runtime", "namespace": NS}],
        }
    )
    names = {"alice": True, "bob": False, "carol": True}  # carol's binding is revoked by a test
    found = {name: token_of(api, name) for name in names}
    for name, bound in names.items():
        if bound:
            bind(api, name)
    return {"runtime": runtime, **found}


@pytest.fixture(scope="module")
def server(cp, tokens, tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("token-auth")
    kubeconfig = work / "runtime.kubeconfig"  # the runtime's own identity: its ServiceAccount
    kubeconfig.write_text(
        kubeconfig_yaml(cp.server, cp.workdir / "pki" / "ca.crt", tokens["runtime"], "runtime")
    )
    env = {
        **ENV,
        "KUBECONFIG": str(kubeconfig),
        "SPYRE_AUTH": "kubernetes",
        "SPYRE_AUTH_MODEL": MODEL,
        "SPYRE_AUTH_NAMESPACE": NS,
        "SPYRE_AUTH_CACHE_SECONDS": str(CACHE_SECONDS),
    }
    srv = ServerProcess(tiny_model, env, work / "server.log")
    with srv.serving():
        yield srv


def call(server, token: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}".strip()} if token is not None else {}
    return HTTP.get(server.base + "/v1/models", headers=headers, timeout=30)


def test_a_service_account_with_a_role_binding_gets_200(server, tokens):
    c = server.client(api_key=tokens["alice"])
    done = c.completions.create(model="tiny", prompt="Hello", max_tokens=2)
    assert done.usage.completion_tokens >= 1
    assert [m.id for m in c.models.list().data] == ["tiny"]


def test_one_without_gets_403(server, tokens):
    with pytest.raises(openai.PermissionDeniedError) as e:
        server.client(api_key=tokens["bob"]).models.list()
    assert (
        f"system:serviceaccount:{NS}:bob may not get spyremodels.spyre-serve.io '{MODEL}'" in e.value.message
    )


def test_a_garbage_or_missing_token_gets_401(server, tokens):
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="garbage.token.value").models.list()
    for token in (None, "", tokens["alice"][:-4] + "AAAA"):  # none, empty, a forged signature
        res = call(server, token)
        assert res.status_code == 401, token
        assert res.json()["error"]["code"] == "invalid_token"


def test_probes_need_no_token(server):
    for path in ("/health", "/metrics", "/version"):
        assert HTTP.get(server.base + path).status_code == 200


def test_a_revoked_role_binding_is_403_after_the_cache_time(server, api, tokens):
    assert call(server, tokens["carol"]).status_code == 200
    client.RbacAuthorizationV1Api(api).delete_namespaced_role_binding(f"carol-uses-{MODEL}", NS)
    revoked = time.monotonic()
    wait_for(lambda: call(server, tokens["carol"]).status_code == 403, timeout=30, what="carol's 403")
    assert time.monotonic() - revoked < CACHE_SECONDS + 10  # the cache time plus RBAC's own propagation


def test_a_stopped_api_server_is_503_then_200_once_it_is_back(server, cp, tokens):
    assert call(server, tokens["alice"]).status_code == 200
    cp.kill_apiserver()
    try:
        time.sleep(CACHE_SECONDS + 0.5)  # alice's cached answer has expired
        down = call(server, tokens["alice"])
        assert down.status_code == 503, down.text
        assert down.json()["error"]["type"] == "service_unavailable"
        with pytest.raises(openai.InternalServerError) as e:
            server.client(api_key=tokens["alice"]).models.list()
        assert e.value.status_code == 503
    finally:
        cp.start_apiserver()
    wait_for(lambda: call(server, tokens["alice"]).status_code == 200, timeout=30, what="200 again")
    assert "token authorization failed closed (503)" in server.log_path.read_text()


def test_a_frozen_api_server_is_503_not_a_hung_request(server, cp, tokens):
    assert call(server, tokens["alice"]).status_code == 200
    time.sleep(CACHE_SECONDS + 0.5)
    cp.pause("kube-apiserver")
    try:
        t0 = time.monotonic()
        assert call(server, tokens["alice"]).status_code == 503
        assert time.monotonic() - t0 < 15
    finally:
        cp.resume("kube-apiserver")
    wait_for(lambda: call(server, tokens["alice"]).status_code == 200, timeout=30, what="200 again")


def test_no_token_reaches_the_log(server, tokens):
    log = server.log_path.read_text()
    assert "Callers need Kubernetes tokens" in log
    for name in ("runtime", "alice", "bob", "carol"):
        assert tokens[name] not in log


def test_in_a_pod_the_runtime_uses_its_service_account(cp, tokens, tmp_path):
    """The in-cluster path (KUBERNETES_SERVICE_HOST and the mounted token and CA), in process."""
    (tmp_path / "token").write_text(tokens["runtime"])
    (tmp_path / "ca.crt").write_bytes((cp.workdir / "pki" / "ca.crt").read_bytes())
    port = cp.server.rsplit(":", 1)[1]
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": port}
    auth = TokenAuth(api_server_from(env, sa_dir=tmp_path), MODEL, NS, cache_seconds=0)
    assert "in-cluster" in auth.describe()

    async def status(token: str) -> int:
        refusal = await auth.refusal(Headers({"authorization": f"Bearer {token}"}))
        return 200 if refusal is None else refusal.status_code

    async def statuses():
        return await asyncio.gather(status(tokens["alice"]), status(tokens["bob"]), status("garbage"))

    assert asyncio.run(statuses()) == [200, 403, 401]


def test_answers_are_cached_allowed_and_denied(cp, tokens, tmp_path):
    """Within the cache time an answer needs no API server: frozen, it still gives 200 and 403 at once."""
    kubeconfig = tmp_path / "runtime.kubeconfig"
    kubeconfig.write_text(
        kubeconfig_yaml(cp.server, cp.workdir / "pki" / "ca.crt", tokens["runtime"], "runtime")
    )
    auth = TokenAuth(api_server_from({"KUBECONFIG": str(kubeconfig)}), MODEL, NS, cache_seconds=60)
    reviews, post = [], auth._post

    async def counted(path, body):  # the real call, counted
        reviews.append(body["kind"])
        return await post(path, body)

    auth._post = counted

    async def statuses(*names):
        refusals = await asyncio.gather(
            *(auth.refusal(Headers({"authorization": f"Bearer {tokens[n]}"})) for n in names)
        )
        return [200 if r is None else r.status_code for r in refusals]

    async def scenario():
        first = await statuses("alice", "bob", "alice", "bob")  # concurrent: one review per token
        cp.pause("kube-apiserver")
        try:
            t0 = time.monotonic()
            cached = await statuses("alice", "bob")
            return first, cached, time.monotonic() - t0
        finally:
            cp.resume("kube-apiserver")

    first, cached, seconds = asyncio.run(scenario())
    assert first == [200, 403, 200, 403]
    assert sorted(reviews) == ["SubjectAccessReview"] * 2 + ["TokenReview"] * 2  # one of each per token
    assert cached == [200, 403] and seconds < 1
    assert len(reviews) == 4
