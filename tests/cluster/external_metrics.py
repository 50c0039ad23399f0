"""A test-only external metrics API (`external.metrics.k8s.io/v1beta1`), as KEDA or prometheus-adapter serve
it, behind a real APIService of the control plane's aggregator: the HorizontalPodAutoscaler controller of the
real kube-controller-manager reads it like any metrics adapter. The test sets each metric's value.

The aggregator dials an APIService's Service at its ClusterIP; the control plane's ClusterIPs are loopback
addresses (controlplane.py), so the server listens on the Service's ClusterIP, port 443, with the control
plane's serving certificate (the APIService skips verification, as test setups do). Availability also wants
an Endpoints object: it names a documentation address (192.0.2.1, RFC 5737) that nothing dials, because the
Endpoints API refuses loopback addresses.

Test infrastructure, never shipped."""

from __future__ import annotations

import contextlib
import datetime
import http.server
import json
import re
import ssl
import threading
import time

from kubernetes import client

GROUP_VERSION = "external.metrics.k8s.io/v1beta1"
APISERVICE = "v1beta1.external.metrics.k8s.io"


class ExternalMetrics:
    def __init__(self, cluster, namespace: str = "default", name: str = "test-external-metrics") -> None:
        self.cluster = cluster
        self.namespace, self.name = namespace, name
        self.values: dict[str, float] = {}  # metric name -> value (every label selector gets the same)
        self.requests: list[str] = []  # paths asked, newest last
        self._server: http.server.ThreadingHTTPServer | None = None

    def start(self, timeout: float = 60.0) -> ExternalMetrics:
        api = self.cluster.api_client()
        core, reg = client.CoreV1Api(api), client.ApiregistrationV1Api(api)
        svc = core.create_namespaced_service(
            self.namespace, {"metadata": {"name": self.name}, "spec": {"ports": [{"port": 443}]}}
        )
        core.create_namespaced_endpoints(
            self.namespace,
            {
                "metadata": {"name": self.name},
                "subsets": [{"addresses": [{"ip": "192.0.2.1"}], "ports": [{"port": 443}]}],
            },
        )
        self._serve(svc.spec.cluster_ip)
        reg.create_api_service(
            {
                "metadata": {"name": APISERVICE},
                "spec": {
                    "group": "external.metrics.k8s.io",
                    "version": "v1beta1",
                    "service": {"namespace": self.namespace, "name": self.name, "port": 443},
                    "insecureSkipTLSVerify": True,
                    "groupPriorityMinimum": 100,
                    "versionPriority": 100,
                },
            }
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            conditions = reg.read_api_service(APISERVICE).status.conditions or []
            if any(c.type == "Available" and c.status == "True" for c in conditions):
                return self
            time.sleep(0.5)
        raise RuntimeError(f"APIService {APISERVICE} not Available within {timeout:.0f} s: {conditions}")

    def stop(self) -> None:
        api = self.cluster.api_client()
        for delete in (
            lambda: client.ApiregistrationV1Api(api).delete_api_service(APISERVICE, _preload_content=False),
            lambda: client.CoreV1Api(api).delete_namespaced_service(
                self.name, self.namespace, _preload_content=False
            ),
        ):
            with contextlib.suppress(client.ApiException):
                delete()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _serve(self, address: str) -> None:
        metrics = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                metrics.requests.append(self.path)
                self._send(metrics.answer(self.path.split("?")[0]))

            def _send(self, body: dict | None) -> None:
                data = json.dumps(body or {"kind": "Status", "status": "Failure", "code": 404}).encode()
                self.send_response(200 if body else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_):
                pass

        server = http.server.ThreadingHTTPServer((address, 443), Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        pki = self.cluster.workdir / "pki"
        ctx.load_cert_chain(pki / "apiserver.crt", pki / "apiserver.key")
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, name="external-metrics", daemon=True).start()
        self._server = server

    def answer(self, path: str) -> dict | None:
        if path.rstrip("/") == f"/apis/{GROUP_VERSION}":
            resources = [
                {
                    "name": name,
                    "singularName": "",
                    "namespaced": True,
                    "kind": "ExternalMetricValueList",
                    "verbs": ["get"],
                }
                for name in self.values
            ]
            return {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": GROUP_VERSION,
                "resources": resources,
            }
        m = re.fullmatch(rf"/apis/{GROUP_VERSION}/namespaces/[^/]+/([^/]+)", path)
        if m is None or m[1] not in self.values:
            return None
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        item = {"metricName": m[1], "metricLabels": {}, "timestamp": now, "value": f"{self.values[m[1]]:g}"}
        return {
            "kind": "ExternalMetricValueList",
            "apiVersion": GROUP_VERSION,
            "metadata": {},
            "items": [item],
        }
