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
