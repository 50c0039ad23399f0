"""The operator's health and metrics endpoint (spyre_operator.io.metrics.serve_health) against clients that
hang up: a kubelet probe or a Prometheus scrape that times out on a loaded node closes its connection before
the answer. The server stays up and says nothing on stderr (the stdlib server printed a BrokenPipeError
traceback, which the end-to-end test reads in the operator's log as a crash)."""

from __future__ import annotations

import socket
import struct

import httpx
import pytest
from spyre_operator.io.metrics import OperatorMetrics, serve_health


@pytest.fixture
def endpoint():
    metrics = OperatorMetrics()
    # a /metrics answer larger than a socket's buffers, so that writing it meets the reset
    for i in range(4000):
        metrics.api_errors.labels(f"Kind{i}", "409").inc()
    server = serve_health(0, metrics, lambda: True, host="127.0.0.1")
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def hang_up(port: int, path: str) -> None:
    """Sends a request, then resets the connection (SO_LINGER 0) without reading the answer."""
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def test_clients_that_hang_up_leave_no_traceback_and_the_server_answers(endpoint, capfd):
    assert len(httpx.get(f"http://127.0.0.1:{endpoint}/metrics").content) > 256 * 1024
    for _ in range(8):
        hang_up(endpoint, "/metrics")
        hang_up(endpoint, "/healthz")
    assert httpx.get(f"http://127.0.0.1:{endpoint}/healthz").text == "ok"
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err[-2000:]
