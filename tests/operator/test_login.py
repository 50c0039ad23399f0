"""The operator's kopf login dials the API server where the kubelet says it is (KUBERNETES_SERVICE_HOST and
_PORT, as its kubernetes client does), not at kopf's fixed https://kubernetes.default.svc, which needs
cluster DNS (a host-network pod on a node without it could not start: found on the real node)."""

from __future__ import annotations

import kopf
import pytest
from spyre_operator.handlers import in_cluster_login

INFO = kopf.ConnectionInfo(server="https://kubernetes.default.svc", token="sa-token", ca_path="/ca.crt")


@pytest.mark.parametrize(
    ("host", "port", "server"),
    [
        ("10.96.0.1", "443", "https://10.96.0.1:443"),
        ("fd00::1", "6443", "https://[fd00::1]:6443"),
        (None, None, "https://kubernetes.default.svc"),
    ],
)
def test_in_cluster_login_uses_the_service_address_the_kubelet_sets(monkeypatch, host, port, server):
    monkeypatch.setattr(kopf, "login_with_service_account", lambda **_: INFO)
    for name, value in (("KUBERNETES_SERVICE_HOST", host), ("KUBERNETES_SERVICE_PORT", port)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    info = in_cluster_login()
    assert info.server == server and info.token == "sa-token" and info.ca_path == "/ca.crt"


def test_outside_a_pod_there_is_no_service_account_login(monkeypatch):
    monkeypatch.setattr(kopf, "login_with_service_account", lambda **_: None)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    assert in_cluster_login() is None
