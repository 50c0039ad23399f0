"""Who may call a model, the runtime's side (issue 40): the API key (from VLLM_API_KEY here, as vLLM reads
it) on everything but /health, /metrics and /version, never in the log or the arguments; HTTPS with a test
CA's certificate, verified by the official client, and no clear text on that port; the settings' one-line
refusals. One server for the module: HTTPS and a key."""

import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import httpx
import openai
import pytest
from spyre_runtime.config import ConfigError
from spyre_runtime.entrypoints.server.security import check_tls, security_from

from tests.runtime.entrypoints.tls_certs import write_test_ca_and_cert
from tests.runtime.serverproc import ServerProcess

KEY = "sk-test-4f0c9e1d2b7a"
ENV = {
    "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager",
    "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "64",
    "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": "8",
    "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "1",
}


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return write_test_ca_and_cert(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def server(tiny_model, certs, tmp_path_factory):
    log = tmp_path_factory.mktemp("secure") / "server.log"
    env = {**ENV, "VLLM_API_KEY": KEY, "SPYRE_SSL_KEYFILE": str(certs["key"])}
    args = ("--ssl-certfile", str(certs["cert"]))  # one by flag, one by variable
    srv = ServerProcess(tiny_model, env, log, extra_args=args, ca_file=certs["ca"])
    with srv.serving():
        yield srv


def client(server, certs, key):
    http = httpx.Client(verify=server.verify)
    return openai.OpenAI(
        base_url=server.base + "/v1", api_key=key, max_retries=0, timeout=60, http_client=http
    )


def test_the_right_key_over_https_is_200(server, certs):
    done = client(server, certs, KEY).completions.create(model="tiny", prompt="Hello", max_tokens=2)
    assert done.choices[0].finish_reason in {"length", "stop"}
    assert done.usage.completion_tokens >= 1


def test_a_wrong_or_missing_key_is_401(server, certs):
    with pytest.raises(openai.AuthenticationError) as wrong:
        client(server, certs, "sk-wrong").models.list()
    assert wrong.value.status_code == 401
    assert wrong.value.body["code"] == "invalid_api_key"
    for headers in ({}, {"authorization": "Basic " + KEY}, {"authorization": f"Bearer {KEY}x"}):
        res = httpx.post(
            server.base + "/v1/completions",
            json={"model": "tiny", "prompt": "x"},
            headers=headers,
            verify=server.verify,
        )
        assert res.status_code == 401, headers
        assert res.headers["www-authenticate"] == "Bearer"
    for method, path in (("POST", "/tokenize"), ("GET", "/v1/models")):  # every API route
        assert httpx.request(method, server.base + path, verify=server.verify).status_code == 401


def test_probes_and_scrapes_need_no_key(server, certs):
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.base + path, verify=server.verify).status_code == 200, path


def test_plain_http_on_the_https_port_fails(server, certs):
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5)
    with pytest.raises(httpx.ConnectError):  # and a client that does not trust the CA refuses the server
        httpx.get(server.base + "/health", timeout=5)


def test_the_key_is_in_neither_the_log_nor_the_arguments(server, certs):
    httpx.get(server.base + "/v1/models", headers={"authorization": f"Bearer {KEY}"}, verify=server.verify)
    log = server.log_path.read_text(errors="replace")
    assert "Callers need an API key" in log
    assert KEY not in log
    cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
    assert KEY.encode() not in cmdline


# ---- the settings: flags over SPYRE_* over VLLM_API_KEY, and one line for every bad one -------------


def args(**kw):
    base = {"api_key": None, "auth": None, "ssl_certfile": None, "ssl_keyfile": None, "ssl_ca_certs": None}
    return Namespace(**{**base, **kw})


def test_the_key_comes_from_the_flag_then_spyre_api_key_then_vllm_api_key():
    env = {"SPYRE_API_KEY": "spyre", "VLLM_API_KEY": "vllm"}
    assert security_from(args(api_key="flag"), env).api_key == "flag"
    assert security_from(args(), env).api_key == "spyre"
    assert security_from(args(), {"VLLM_API_KEY": "vllm"}).api_key == "vllm"
    assert security_from(args(), {"SPYRE_API_KEY": ""}).api_key is None


KUBE = {"SPYRE_AUTH": "kubernetes", "SPYRE_AUTH_MODEL": "m", "SPYRE_AUTH_NAMESPACE": "ns"}


@pytest.mark.parametrize(
    ("env", "kw", "named"),
    [
        ({"SPYRE_AUTH": "openshift"}, {}, "SPYRE_AUTH='openshift'"),
        ({**KUBE, "SPYRE_AUTH_MODEL": ""}, {}, "SPYRE_AUTH_MODEL is not set"),
        ({"SPYRE_AUTH": "kubernetes", "SPYRE_AUTH_MODEL": "m"}, {}, "SPYRE_AUTH_NAMESPACE is not set"),
        ({**KUBE, "SPYRE_AUTH_CACHE_SECONDS": "soon"}, {}, "SPYRE_AUTH_CACHE_SECONDS='soon'"),
        ({**KUBE, "SPYRE_AUTH_CACHE_SECONDS": "-1"}, {}, "SPYRE_AUTH_CACHE_SECONDS='-1'"),
        ({**KUBE, "VLLM_API_KEY": "k"}, {}, "cannot be used together"),
        (
            {"SPYRE_AUTH_MODEL": "m", "SPYRE_AUTH_NAMESPACE": "ns"},
            {"auth": "kubernetes", "api_key": "k"},
            "together",
        ),
    ],
)
def test_a_bad_auth_setting_is_one_line_naming_it(env, kw, named):
    with pytest.raises(ConfigError) as e:
        security_from(args(**kw), env)
    assert named in str(e.value) and "\n" not in str(e.value)


def test_token_authorization_settings():
    s = security_from(args(), {**KUBE, "SPYRE_AUTH_CACHE_SECONDS": "2.5"})
    assert (s.kubernetes.model, s.kubernetes.namespace, s.kubernetes.cache_seconds) == ("m", "ns", 2.5)
    assert security_from(args(auth="kubernetes"), {**KUBE, "SPYRE_AUTH": ""}).kubernetes.cache_seconds == 10
    with pytest.raises(ConfigError, match="no usable kubeconfig"):
        s.authorizer({"KUBECONFIG": "/nonexistent/kubeconfig"})


def test_bad_tls_files_are_one_line_naming_them(certs, tmp_path):
    other = write_test_ca_and_cert(tmp_path)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cert, key = str(certs["cert"]), str(certs["key"])
    cases = [
        ((cert, None, None), "--ssl-certfile (SPYRE_SSL_CERTFILE) needs --ssl-keyfile"),
        ((None, key, None), "--ssl-keyfile (SPYRE_SSL_KEYFILE) needs --ssl-certfile"),
        ((None, None, cert), "--ssl-ca-certs (SPYRE_SSL_CA_CERTS) needs"),
        (("/nonexistent/tls.crt", key, None), "/nonexistent/tls.crt: cannot be read (No such file"),
        ((str(garbage), key, None), "garbage.pem: not a PEM certificate"),
        ((cert, str(garbage), None), "garbage.pem: not a PEM private key"),
        ((cert, str(other["key"]), None), "the key does not match the certificate"),
        ((cert, key, str(garbage)), "garbage.pem: not PEM certificates"),
    ]
    for files, named in cases:
        with pytest.raises(ConfigError) as e:
            check_tls(*files)
        assert named in str(e.value) and "\n" not in str(e.value), files
    check_tls(cert, key, str(certs["ca"]))


def test_a_missing_certificate_stops_serve_with_one_line(tiny_model, certs):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "spyre_runtime.cli",
            "serve",
            str(tiny_model),
            "--ssl-keyfile",
            str(certs["key"]),
        ],
        env={**os.environ, "SPYRE_SSL_CERTFILE": "/nonexistent/tls.crt"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert lines == [
        "spyre-runtime: error: --ssl-certfile (SPYRE_SSL_CERTFILE) /nonexistent/tls.crt: cannot be read "
        "(No such file or directory)"
    ], res.stderr
