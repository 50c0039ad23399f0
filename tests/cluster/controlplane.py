"""A real Kubernetes 1.20 control plane on 127.0.0.1 for tests: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler as local processes, plus pseudo Spyre nodes.

Test infrastructure, never shipped. Every process is started here and stopped here, by PID.
The binaries come from tests/cluster/build-k8s.sh (shared/DESIGN.md section 4).
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import datetime
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

K8S_VERSION = "1.20.2"
DEFAULT_CARD_RESOURCE = "ibm.com/spyre_pf"
COMPONENTS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
HOSTNAME_LABEL = "kubernetes.io/hostname"

log = logging.getLogger(__name__)


class ControlPlaneError(RuntimeError):
    """Start-up failed; the message names the step, the component and its last log lines."""


def default_bin_dir() -> Path:
    cache = os.environ.get("SPYRE_K8S_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "spyre-serve"
    )
    return Path(cache, f"k8s-{K8S_VERSION}", "bin")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
        return False


def pid_alive(pid: int) -> bool:
    """True for a running process; a zombie (exited, not reaped) answers kill(0) but counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when the process that started it dies (even by SIGKILL)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


def tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log written)"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Proc:
    name: str
    pid: int
    log: Path
    popen: subprocess.Popen | None = None  # absent when re-attached from a state file

    def is_alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return pid_alive(self.pid)


@dataclass
class PseudoNode:
    name: str
    cards: int
    card_resource: str = DEFAULT_CARD_RESOURCE
    cpu: str = "32"
    memory: str = "256Gi"
    pods: str = "110"
    product: str = "IBM_Spyre"
    extra_labels: dict[str, str] = field(default_factory=dict)

    def labels(self) -> dict[str, str]:
        return {
            HOSTNAME_LABEL: self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "ibm.com/spyre.present": "true",
            "ibm.com/spyre.product": self.product,
            "ibm.com/spyre.count": str(self.cards),
            **self.extra_labels,
        }

    def capacity(self) -> dict[str, str]:
        return {
            "cpu": self.cpu,
            "memory": self.memory,
            "pods": self.pods,
            "ephemeral-storage": "500Gi",
            self.card_resource: str(self.cards),
        }


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler on 127.0.0.1.

    Use as a context manager, or start()/stop(). `state.json` in the work dir records every PID so
    that `python -m tests.cluster down` can stop a cluster left running by `up`.
    """

    def __init__(
        self,
        workdir: Path | None = None,
        bin_dir: Path | None = None,
        etcd_bin: str | None = None,
        apiserver_port: int | None = None,
        die_with_parent: bool = True,
        ready_timeout: float = 90.0,
        extra_apiserver_args: tuple[str, ...] = (),
        extra_ip_sans: tuple[str, ...] = (),
    ) -> None:
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="spyre-k8s-"))
        self.bin_dir = Path(bin_dir or default_bin_dir())
        self.etcd_bin = etcd_bin or shutil.which("etcd") or "/usr/bin/etcd"
        self.apiserver_port = apiserver_port
        self.die_with_parent = die_with_parent
        self.ready_timeout = ready_timeout
        self.extra_apiserver_args = tuple(extra_apiserver_args)
        self.extra_ip_sans = tuple(extra_ip_sans)  # more addresses the API server's certificate is valid for
        self.procs: list[Proc] = []
        self.ports: dict[str, int] = {}
        self.admin_token = os.urandom(16).hex()
        self.kubeconfig = self.workdir / "kubeconfig"
        self.startup_seconds: float | None = None

    # ---- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['kube-apiserver']}"

    def start(self) -> None:
        t0 = time.monotonic()
        try:
            self._check_binaries()
            self._choose_ports()
            self._write_pki_and_tokens()
            self._write_kubeconfigs()
            self._on_free_ports(("etcd-client", "etcd-peer"), self._start_etcd)
            self._start_apiserver()
            self._on_free_ports(("kube-controller-manager",), self._start_controller_manager)
            self._on_free_ports(("kube-scheduler",), self._start_scheduler)
            self._write_state()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0

    def _on_free_ports(self, names: tuple[str, ...], start, attempts: int = 3) -> None:
        """Runs `start`; when its process exits because another one bound a port of `names` between
        `free_port()` choosing it and the bind (test modules run in parallel, each choosing ports), chooses
        new ports and starts it again, up to `attempts` times. Any other failure is raised as it is."""
        for attempt in range(attempts):
            try:
                start()
                return
            except ControlPlaneError as e:
                if "address already in use" not in str(e) or attempt == attempts - 1:
                    raise
                log.warning("%s: a port was taken before it bound; starting it on new ports", names[0])
                self.procs = [p for p in self.procs if p.is_alive()]
                for name in names:
                    self.ports[name] = free_port()

    def stop(self, grace: float = 10.0) -> None:
        """Stops every started process, newest first: SIGTERM, then SIGKILL after `grace` seconds."""
        for proc in reversed(self.procs):
            terminate(proc, grace)
        self.procs.clear()
        state = self.workdir / "state.json"
        state.unlink(missing_ok=True)

    # ---- chaos: what a real control plane goes through ------------------------------------------

    def _proc(self, name: str) -> Proc:
        for proc in self.procs:
            if proc.name == name and proc.is_alive():
                return proc
        raise ControlPlaneError(f"{name} is not running")

    def pause(self, name: str) -> None:
        """Freezes a component (SIGSTOP), as a stalled disk or a long GC pause does: connections stay open
        and nothing answers."""
        os.kill(self._proc(name).pid, signal.SIGSTOP)

    def resume(self, name: str) -> None:
        os.kill(self._proc(name).pid, signal.SIGCONT)

    def restart_apiserver(self, down_seconds: float = 0.0) -> None:
        """Kills kube-apiserver (SIGKILL: no graceful shutdown, watches break mid-stream), keeps it down for
        `down_seconds` (connections are refused meanwhile), and starts it again on the same port."""
        self.kill_apiserver()
        time.sleep(down_seconds)
        self.start_apiserver()

    def kill_apiserver(self) -> None:
        """SIGKILL to kube-apiserver: connections are refused until start_apiserver()."""
        proc = self._proc("kube-apiserver")
        os.kill(proc.pid, signal.SIGKILL)
        if proc.popen is not None:
            proc.popen.wait(timeout=30)
        self.procs.remove(proc)

    def start_apiserver(self) -> None:
        """Starts kube-apiserver again on its port, from the main thread: a child started from another
        thread gets its parent-death signal when that thread ends."""
        self._start_apiserver()
        self._write_state()

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        """Runs the kubectl built with the control plane (same version, no skew warning)."""
        return subprocess.run(
            [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
        )

    # ---- steps -----------------------------------------------------------------------------------

    def _check_binaries(self) -> None:
        for name in COMPONENTS:
            path = self.bin_dir / name
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise ControlPlaneError(
                    f"{name} binary not found at {path}; build it with tests/cluster/build-k8s.sh "
                    "(or set SPYRE_K8S_CACHE to where the binaries are)"
                )
        if not (Path(self.etcd_bin).is_file() and os.access(self.etcd_bin, os.X_OK)):
            raise ControlPlaneError(
                f"etcd binary not found at {self.etcd_bin}; install Debian's etcd-server package"
            )

    def _choose_ports(self) -> None:
        wanted = {
            "etcd-client": None,
            "etcd-peer": None,
            "kube-apiserver": self.apiserver_port,
            "kube-controller-manager": None,
            "kube-scheduler": None,
        }
        for name, port in wanted.items():
            if port is not None and is_port_in_use(port):
                raise ControlPlaneError(
                    f"{name} cannot start: port 127.0.0.1:{port} is already in use by another process"
                )
            self.ports[name] = port if port is not None else free_port()

    def _write_pki_and_tokens(self) -> None:
        pki = self.workdir / "pki"
        pki.mkdir(parents=True, exist_ok=True)
        write_pki(pki, self.extra_ip_sans)
        # token,user,uid,"group1,group2" — the admin, the two components and nothing else
        rows = [
            f'{self.admin_token},admin,admin,"system:masters"',
            f'{os.urandom(16).hex()},system:kube-controller-manager,kcm,"system:masters"',
            f"{os.urandom(16).hex()},system:kube-scheduler,sched",
        ]
        (pki / "tokens.csv").write_text("\n".join(rows) + "\n")
        os.chmod(pki / "tokens.csv", 0o600)
        self._tokens = {row.split(",")[1]: row.split(",")[0] for row in rows}

    def _write_kubeconfigs(self) -> None:
        pki = self.workdir / "pki"
        self.kubeconfig.write_text(kubeconfig_yaml(self.server, pki / "ca.crt", self.admin_token, "admin"))
        for user in ("system:kube-controller-manager", "system:kube-scheduler"):
            short = user.split(":")[1]
            (self.workdir / f"{short}.kubeconfig").write_text(
                kubeconfig_yaml(self.server, pki / "ca.crt", self._tokens[user], user)
            )

    def _spawn(self, name: str, argv: list[str]) -> Proc:
        log = self.workdir / f"{name}.log"
        out = open(log, "ab")  # noqa: SIM115 - the child owns it
        try:
            popen = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.workdir,
                preexec_fn=_die_with_parent if self.die_with_parent else None,
                start_new_session=not self.die_with_parent,
            )
        except OSError as e:
            raise ControlPlaneError(f"{name} could not be started ({argv[0]}): {e}") from e
        finally:
            out.close()
        proc = Proc(name, popen.pid, log, popen)
        self.procs.append(proc)
        return proc

    def _wait_ready(self, proc: Proc, url: str, token: str | None) -> None:
        ctx = ssl.create_default_context(cafile=str(self.workdir / "pki" / "ca.crt"))
        ctx.check_hostname = False
        if not url.startswith("https://127.0.0.1:" + str(self.ports["kube-apiserver"])):
            ctx.verify_mode = ssl.CERT_NONE  # components serve self-signed certificates of their own
        deadline = time.monotonic() + self.ready_timeout
        last = ""
        while time.monotonic() < deadline:
            if not proc.is_alive():
                raise ControlPlaneError(
                    f"{proc.name} exited during start-up (code {proc.popen.poll() if proc.popen else '?'})"
                    f"; last log lines of {proc.log}:\n{tail(proc.log)}"
                )
            req = urllib.request.Request(url)
            if token:
                req.add_header("Authorization", f"Bearer {token}")
            try:
                with urllib.request.urlopen(req, timeout=3, context=ctx) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError) as e:
                last = str(e)
            time.sleep(0.3)
        raise ControlPlaneError(
            f"{proc.name} was not ready at {url} within {self.ready_timeout:.0f} s (last answer: {last})"
            f"; last log lines of {proc.log}:\n{tail(proc.log)}"
        )

    def _start_etcd(self) -> None:
        client, peer = self.ports["etcd-client"], self.ports["etcd-peer"]
        shutil.rmtree(self.workdir / "etcd-data", ignore_errors=True)  # every start is a fresh cluster
        proc = self._spawn(
            "etcd",
            [
                self.etcd_bin,
                "--name=default",
                f"--data-dir={self.workdir / 'etcd-data'}",
                f"--listen-client-urls=http://127.0.0.1:{client}",
                f"--advertise-client-urls=http://127.0.0.1:{client}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=default=http://127.0.0.1:{peer}",
                "--listen-metrics-urls=",
                "--log-level=warn",
                "--logger=zap",
            ],
        )
        self._wait_ready(proc, f"http://127.0.0.1:{client}/health", None)

    def _start_apiserver(self) -> None:
        pki = self.workdir / "pki"
        port = self.ports["kube-apiserver"]
        proc = self._spawn(
            "kube-apiserver",
            [
                str(self.bin_dir / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{self.ports['etcd-client']}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={port}",
                "--insecure-port=0",
                f"--cert-dir={pki}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--token-auth-file={pki / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                "--anonymous-auth=false",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                # ClusterIPs on loopback: nothing routes a Service's ClusterIP here (no kube-proxy), except
                # the aggregator, which dials an APIService's Service at its ClusterIP (tests serve there)
                "--service-cluster-ip-range=127.96.0.0/16",
                # what a production cluster adds to 1.20's defaults (ResourceQuota and Priority are on by
                # default): owner references that block deletion need the owner's finalizers permission
                "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
                "--allow-privileged=true",
                "--endpoint-reconciler-type=none",
                "--enable-priority-and-fairness=false",
                # logs, exec and port-forward reach a real node's kubelet (tests/cluster/node.py) at its
                # InternalIP (its Hostname resolves nowhere), with a client certificate the kubelet trusts
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                f"--kubelet-client-certificate={pki / 'kubelet-client.crt'}",
                f"--kubelet-client-key={pki / 'kubelet-client.key'}",
                "--v=1",
                *self.extra_apiserver_args,
            ],
        )
        self._wait_ready(proc, f"https://127.0.0.1:{port}/readyz", self.admin_token)

    def _start_controller_manager(self) -> None:
        pki = self.workdir / "pki"
        kc = self.workdir / "kube-controller-manager.kubeconfig"
        port = self.ports["kube-controller-manager"]
        proc = self._spawn(
            "kube-controller-manager",
            [
                str(self.bin_dir / "kube-controller-manager"),
                f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                "--port=0",
                f"--cert-dir={pki / 'kcm'}",
                "--leader-elect=false",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                # No kubelet posts heartbeats for the pseudo nodes: without this the node lifecycle
                # controller would mark them unreachable after 40 s and taint them.
                "--controllers=*,-nodelifecycle",
                "--horizontal-pod-autoscaler-sync-period=3s",
                "--v=1",
            ],
        )
        self._wait_ready(proc, f"https://127.0.0.1:{port}/healthz", None)

    def _start_scheduler(self) -> None:
        pki = self.workdir / "pki"
        kc = self.workdir / "kube-scheduler.kubeconfig"
        port = self.ports["kube-scheduler"]
        proc = self._spawn(
            "kube-scheduler",
            [
                str(self.bin_dir / "kube-scheduler"),
                f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                "--port=0",
                f"--cert-dir={pki / 'sched'}",
                "--leader-elect=false",
                "--v=1",
            ],
        )
        self._wait_ready(proc, f"https://127.0.0.1:{port}/healthz", None)

    def _write_state(self) -> None:
        state = {
            "pids": {p.name: p.pid for p in self.procs},
            "logs": {p.name: str(p.log) for p in self.procs},
            "ports": self.ports,
            "kubeconfig": str(self.kubeconfig),
        }
        (self.workdir / "state.json").write_text(json.dumps(state, indent=2))

    # ---- nodes -----------------------------------------------------------------------------------

    def api_client(self):
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def register_nodes(self, nodes: Iterable[PseudoNode]) -> list[str]:
        """Creates Node objects with card capacity, Ready and untainted, as a device plugin would."""
        return register_nodes(self.api_client(), nodes)


def spyre_nodes(
    count: int = 2, cards: int = 8, card_resource: str = DEFAULT_CARD_RESOURCE, prefix: str = "spyre-node"
) -> list[PseudoNode]:
    return [PseudoNode(f"{prefix}-{i}", cards, card_resource) for i in range(count)]


def register_nodes(api_client, nodes: Iterable[PseudoNode]) -> list[str]:
    from kubernetes import client

    core = client.CoreV1Api(api_client)
    names = []
    for node in nodes:
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": node.name, "labels": node.labels()},
            "spec": {},
        }
        core.create_node(body)
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        status = {
            "status": {
                "capacity": node.capacity(),
                "allocatable": node.capacity(),
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "PseudoSpyreNode",
                        "message": "pseudo Spyre node registered by the test control plane",
                        "lastHeartbeatTime": now,
                        "lastTransitionTime": now,
                    }
                ],
                "nodeInfo": {
                    "architecture": "amd64",
                    "operatingSystem": "linux",
                    "kubeletVersion": f"v{K8S_VERSION}",
                    "kubeProxyVersion": f"v{K8S_VERSION}",
                    "bootID": "",
                    "containerRuntimeVersion": "spyre-pod-runner://0",
                    "kernelVersion": "",
                    "machineID": "",
                    "osImage": "pseudo",
                    "systemUUID": "",
                },
                "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
            }
        }
        core.patch_node_status(node.name, status)
        # The TaintNodesByCondition admission plugin adds not-ready on creation; the node is Ready now.
        taints = core.read_node(node.name).spec.taints or []
        kept = [t for t in taints if t.key != "node.kubernetes.io/not-ready"]
        if len(kept) != len(taints):
            core.patch_node(node.name, {"spec": {"taints": [t.to_dict() for t in kept] or None}})
        names.append(node.name)
    return names


def terminate(proc: Proc, grace: float = 10.0) -> None:
    if not proc.is_alive():
        if proc.popen is not None:
            proc.popen.wait()
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and proc.is_alive():
        time.sleep(0.05)
    if proc.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
    if proc.popen is not None:
        proc.popen.wait(timeout=10)
    else:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and proc.is_alive():
            time.sleep(0.05)


def service_account_token(core, namespace: str, name: str) -> str | None:
    """The token the controller-manager minted for a service account, or None while there is none yet."""
    sa = core.read_namespaced_service_account(name, namespace)
    secrets = [s.name for s in sa.secrets or []]
    if not secrets:
        return None
    encoded = (core.read_namespaced_secret(secrets[0], namespace).data or {}).get("token")
    return base64.b64decode(encoded).decode() if encoded else None


def kubeconfig_yaml(server: str, ca: Path, token: str, user: str, namespace: str | None = None) -> str:
    context = {"cluster": "spyre-local", "user": user, **({"namespace": namespace} if namespace else {})}
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "spyre-local", "cluster": {"server": server, "certificate-authority": str(ca)}}
            ],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "spyre-local", "context": context}],
            "current-context": "spyre-local",
        },
        indent=2,
    )


def write_pki(pki: Path, extra_ip_sans: tuple[str, ...] = ()) -> None:
    """A CA, a serving certificate for 127.0.0.1/localhost (and `extra_ip_sans`), and the service-account key
    pair."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import NameOID

    def pem_key(key) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "spyre-local-ca")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=7))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(ca_key, hashes.SHA256())
    )
    srv_key = ec.generate_private_key(ec.SECP256R1())
    srv_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
        .issuer_name(ca_name)
        .public_key(srv_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=7))
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.DNSName("kubernetes"),
                    x509.DNSName("kubernetes.default.svc"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    *(x509.IPAddress(ipaddress.ip_address(a)) for a in extra_ip_sans),
                ]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    files = {
        "ca.crt": ca_cert.public_bytes(serialization.Encoding.PEM),
        "ca.key": pem_key(ca_key),
        "apiserver.crt": srv_cert.public_bytes(serialization.Encoding.PEM),
        "apiserver.key": pem_key(srv_key),
        "sa.key": pem_key(sa_key),
        "sa.pub": sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
    }
    for name, data in files.items():
        (pki / name).write_bytes(data)
        os.chmod(pki / name, 0o600)
    issue_client_cert(pki, "kubelet-client", "kube-apiserver-kubelet-client", ["system:masters"])


def issue_client_cert(pki: Path, name: str, common_name: str, groups: list[str]) -> tuple[Path, Path]:
    """A client certificate signed by the test CA (pki/ca.key): the API server authenticates it as user
    `common_name` in `groups`. Writes pki/NAME.crt and pki/NAME.key; returns their paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), None)
    ca_cert = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([*subject, x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=7))
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    crt, key_path = pki / f"{name}.crt", pki / f"{name}.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    os.chmod(key_path, 0o600)
    return crt, key_path
