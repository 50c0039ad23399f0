"""What the reporter reads off warming pods."""

from __future__ import annotations

from spyre_operator.kinds.pods.observe import observe_pod
from spyre_operator.settings import HASH_LABEL

from tests.operator.objects import NOW, pod, status_of


def test_warming_pods_progress_reaches_the_progressing_message():
    import http.server
    import json as _json
    import threading as _threading

    from spyre_operator.status.report import warmup_progress

    class Warming(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = _json.dumps({"status": "warming up", "warming": {"done": 7, "total": 12}}).encode()
            self.send_response(503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Warming)
    _threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        warm = pod("w", ready=False)
        warm["status"]["podIP"] = "127.0.0.1"
        pods = [pod("a"), warm]
        observed = [observe_pod(p, "ibm.com/spyre_pf", HASH_LABEL, now=NOW) for p in pods]
        progress = warmup_progress(pods, observed, server.server_address[1])
    finally:
        server.shutdown()
    assert progress == {"w": (7, 12)}
    status = status_of(pods, replicas=2, warming=progress)
    msg = {c["type"]: c for c in status["conditions"]}["Progressing"]["message"]
    assert msg.endswith("w: compiling 7/12")


def _stall(handler):
    handler.server.release.wait(10)


def _status_503(handler, body: bytes, length: int | None = None):
    handler.send_response(503)
    handler.send_header("Content-Length", str(len(body) if length is None else length))
    handler.end_headers()
    handler.wfile.write(body)
    handler.wfile.flush()


# How a warming pod's /health can misbehave under a node's load or a bug: each case must leave that pod out of
# the count and never raise (a read that timed out in the body once failed a whole reconcile pass).
MISBEHAVIOURS = {
    "body stalls after the headers": lambda h: (_status_503(h, b'{"warming": ', 100), _stall(h)),
    "body cut off": lambda h: (_status_503(h, b'{"warming": ', 100), h.connection.close()),
    "not an HTTP status line": lambda h: (h.wfile.write(b"garbage\r\n\r\n"), h.wfile.flush()),
    "headers never end": lambda h: (h.wfile.write(b"HTTP/1.1 503 Busy\r\n"), h.wfile.flush(), _stall(h)),
    "no answer at all": _stall,
    "closed at once": lambda h: h.connection.close(),
    "not JSON": lambda h: _status_503(h, b"<html>busy</html>"),
    "a JSON list": lambda h: _status_503(h, b"[1, 2]"),
    "warming is a list": lambda h: _status_503(h, b'{"warming": [7, 12]}'),
    "counts are words": lambda h: _status_503(h, b'{"warming": {"done": "seven", "total": 12}}'),
}


def test_a_misbehaving_warming_pod_is_left_out_and_the_others_still_count():
    import http.server
    import json as _json
    import threading as _threading

    import pytest
    from spyre_operator.status.report import warmup_progress

    class Good(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            _status_503(self, _json.dumps({"warming": {"done": 3, "total": 4}}).encode())

        def log_message(self, *args):
            pass

    good = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Good)
    port = good.server_address[1]
    servers = [good]
    _threading.Thread(target=good.serve_forever, args=(0.05,), daemon=True).start()
    try:
        for name, act in MISBEHAVIOURS.items():

            class Bad(http.server.BaseHTTPRequestHandler):
                misbehave = staticmethod(act)

                def do_GET(self):
                    self.misbehave(self)

                def log_message(self, *args):
                    pass

            try:
                bad = http.server.ThreadingHTTPServer(("127.0.0.2", port), Bad)
            except OSError:
                pytest.fail(f"127.0.0.2:{port} is taken; the case {name!r} needs the same port as 127.0.0.1")
            bad.daemon_threads = True
            bad.release = _threading.Event()
            servers.append(bad)
            _threading.Thread(target=bad.serve_forever, args=(0.05,), daemon=True).start()
            pods = [pod("bad", ready=False), pod("good", ready=False)]
            pods[0]["status"]["podIP"], pods[1]["status"]["podIP"] = "127.0.0.2", "127.0.0.1"
            observed = [observe_pod(p, "ibm.com/spyre_pf", HASH_LABEL, now=NOW) for p in pods]
            assert warmup_progress(pods, observed, port) == {"good": (3, 4)}, name
            bad.release.set()
            bad.shutdown()
            bad.server_close()
            servers.remove(bad)
    finally:
        for s in servers:
            getattr(s, "release", _threading.Event()).set()
            s.shutdown()
            s.server_close()
