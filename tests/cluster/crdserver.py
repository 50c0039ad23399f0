"""The standalone CRD API server of a current Kubernetes (k8s.io/apiextensions-apiserver, at least 1.34: the
build checks it and records the version beside the binary, `crd_server_version()`), run beside the 1.20
control plane: its own etcd prefix in the control plane's etcd, authentication and authorization delegated
to the 1.20 API server (TokenReview, SubjectAccessReview). It serves only /apis/apiextensions.k8s.io and the
custom resources, so it is spoken to with plain HTTPS requests and the admin's bearer token, not kubectl.

Test infrastructure, never shipped. Built by tests/cluster/build-crd-server.sh (shared/DESIGN.md section 9);
started and stopped here, by PID.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.cluster.controlplane import ControlPlane, ControlPlaneError, Proc, free_port, tail, terminate

REPO = Path(__file__).resolve().parents[2]
MIN_VERSION = (1, 34)  # what build-crd-server.sh accepts
# admission plugins that wait for informers of APIs the 1.20 server does not serve (they would keep the
# server "not yet ready to handle request" forever), and namespace lifecycle (no /api to read namespaces from)
DISABLED_ADMISSION = (
    "ValidatingAdmissionPolicy,MutatingAdmissionPolicy,NamespaceLifecycle,"
    "ValidatingAdmissionWebhook,MutatingAdmissionWebhook"
)


def crd_server_binary() -> Path:
    cache = os.environ.get("SPYRE_K8S_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "spyre-serve"
    )
    return Path(cache, "crd-server", "bin", "apiextensions-apiserver")


def crd_server_version() -> str:
    """The Kubernetes version the build found, checked and stamped into the binary (e.g. "1.34.1")."""
    record = crd_server_binary().with_name("apiextensions-apiserver.version")
    try:
        version = record.read_text().strip()
    except FileNotFoundError:
        raise ControlPlaneError(
            f"{record} is missing: run tests/cluster/build-crd-server.sh (it checks and records the version)"
        ) from None
    parts = version.split(".")
    if len(parts) < 2 or not all(p.isdigit() for p in parts) or tuple(map(int, parts[:2])) < MIN_VERSION:
        raise ControlPlaneError(f"{record} says {version!r}: the CRD server must be Kubernetes 1.34 or newer")
    return version


def ensure_crd_server_binary() -> Path:
    binary = crd_server_binary()
    if not binary.exists() or not binary.with_name("apiextensions-apiserver.version").exists():
        subprocess.run(["bash", str(REPO / "tests/cluster/build-crd-server.sh")], check=True)
    return binary


class Answer:
    """One HTTP answer: status code and the decoded JSON body (a Status object for errors)."""

    def __init__(self, code: int, body: dict) -> None:
        self.code, self.body = code, body

    @property
    def message(self) -> str:
        return self.body.get("message", "")

    def __repr__(self) -> str:
        return f"Answer({self.code}, {self.message or self.body.get('kind')!r})"


class CRDServer:
    def __init__(self, cluster: ControlPlane, workdir: Path, ready_timeout: float = 120.0) -> None:
        self.cluster = cluster
        self.workdir = workdir
        self.ready_timeout = ready_timeout
        self.port = free_port()
        self.proc: Proc | None = None
        self.version = ""  # the recorded Kubernetes version, once started
        self._ctx = ssl.create_default_context()
        self._ctx.check_hostname = False
        self._ctx.verify_mode = ssl.CERT_NONE  # it serves a self-signed certificate of its own

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def start(self) -> CRDServer:
        binary = ensure_crd_server_binary()
        self.version = crd_server_version()
        self.workdir.mkdir(parents=True, exist_ok=True)
        kubeconfig = str(self.cluster.kubeconfig)
        argv = [
            str(binary),
            f"--etcd-servers=http://127.0.0.1:{self.cluster.ports['etcd-client']}",
            "--etcd-prefix=/spyre-crd-server",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.port}",
            f"--cert-dir={self.workdir / 'pki'}",
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            f"--disable-admission-plugins={DISABLED_ADMISSION}",
            "--enable-priority-and-fairness=false",
            "--v=1",
        ]
        log = self.workdir / "crd-server.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.workdir
            )
        self.proc = Proc("apiextensions-apiserver", popen.pid, log, popen)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc)
            self.proc = None

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        last = None
        while time.monotonic() < deadline:
            if not self.proc.is_alive():
                raise ControlPlaneError(
                    f"the {self.version} CRD server exited during start-up; last log lines of "
                    f"{self.proc.log}:\n{tail(self.proc.log)}"
                )
            last = self.request("GET", "/readyz")
            if last.code == 200:
                return
            time.sleep(0.5)
        raise ControlPlaneError(
            f"the {self.version} CRD server was not ready within {self.ready_timeout:.0f} s "
            f"(last answer: {last}); last log lines of {self.proc.log}:\n{tail(self.proc.log)}"
        )

    def request(self, method: str, path: str, body: dict | None = None) -> Answer:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.cluster.admin_token}")
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=30, context=self._ctx) as resp:
                return Answer(resp.status, _json(resp.read()))
        except urllib.error.HTTPError as e:
            return Answer(e.code, _json(e.read()))
        except (urllib.error.URLError, OSError) as e:
            return Answer(0, {"message": str(e)})

    def apply_crd(self, crd: dict, timeout: float = 60.0) -> dict:
        """Creates (or replaces) the CRD and waits until it is Established; returns its conditions by type.
        Fails with the server's own message when the CRD is refused."""
        name = crd["metadata"]["name"]
        path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
        answer = self.request("POST", path, crd)
        if answer.code == 409:
            current = self.request("GET", f"{path}/{name}").body
            crd = {
                **crd,
                "metadata": {**crd["metadata"], "resourceVersion": current["metadata"]["resourceVersion"]},
            }
            answer = self.request("PUT", f"{path}/{name}", crd)
        if answer.code not in (200, 201):
            raise AssertionError(f"the {self.version} CRD server refused CRD {name}: {answer}")
        deadline = time.monotonic() + timeout
        conditions: dict = {}
        while time.monotonic() < deadline:
            status = self.request("GET", f"{path}/{name}").body.get("status", {})
            conditions = {c["type"]: c for c in status.get("conditions") or []}
            if conditions.get("Established", {}).get("status") == "True":
                return conditions
            time.sleep(0.3)
        raise AssertionError(f"CRD {name} was not Established within {timeout:.0f} s: {conditions}")

    def delete_crd(self, name: str) -> Answer:
        return self.request("DELETE", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")


def _json(raw: bytes) -> dict:
    try:
        return json.loads(raw or b"{}")
    except ValueError:
        return {"message": raw.decode(errors="replace")}
