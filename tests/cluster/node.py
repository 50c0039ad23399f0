"""A real Kubernetes node on this machine for tests (issue 34): the kubelet 1.20.2
(tests/cluster/build-node.sh) running pods through containerd and runc, pulling the project's images from a
local registry (tests/cluster/build-images.sh), pods on a CNI bridge of their own, and the test device plugin
advertising Spyre cards.

Everything is configured under the test's folder and bound to this machine: the registry and containerd's
stream server on 127.0.0.1, the kubelet on the bridge's own address (the 1.20 kubelet refuses a loopback
node IP), the pods' bridge neither masqueraded nor routed out (the pods get no default route). What the
kubelet changes on the host (sysctls, cgroups, mounts, fixed folders) is recorded first and put back at the
end, pass or fail (tests/cluster/hoststate.py); every process is stopped by PID.

Test infrastructure, never shipped.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests.cluster import images
from tests.cluster.controlplane import (
    ControlPlane,
    Proc,
    _die_with_parent,
    free_port,
    issue_client_cert,
    kubeconfig_yaml,
    tail,
    terminate,
)
from tests.cluster.deviceplugin import KUBELET_SOCKET_DIR, TestDevicePlugin
from tests.cluster.hoststate import HostState
from tests.cluster.tcprelay import TcpRelay

LOCK = Path("/run/lock/spyre-serve-real-node.lock")
CARD_RESOURCE = "ibm.com/spyre_pf"
EVICTION_FREE = "1Gi"  # the kubelet's hard eviction threshold for the node's and the images' disk
NEED_FREE_BYTES = 4 * 2**30  # the threshold plus what a module's pods, images and logs write
# what the control plane needs for a real kubelet: the Node authorizer and NodeRestriction, as clusters run
APISERVER_ARGS = ("--authorization-mode=Node", "--enable-admission-plugins=NodeRestriction")


class NodeError(RuntimeError):
    """The node could not start; the message names the step and the component's last log lines."""


def missing_prerequisites(image_kinds: tuple[str, ...] = ("pause",)) -> list[str]:
    """What build-node.sh / build-images.sh have not made yet of the node and of the images named (empty when
    all are there)."""
    from tests.cluster.controlplane import default_bin_dir

    missing = [str(default_bin_dir() / "kubelet")] if not (default_bin_dir() / "kubelet").exists() else []
    missing += [t for t in ("containerd", "runc", "docker-registry") if not shutil.which(t)]
    missing += [f"image {images.ref(k)}" for k in image_kinds if not images.cached(k)]
    if os.geteuid() != 0:
        missing.append("root (the kubelet and containerd run as root)")
    return missing


def check_free_disk(path: Path, need: int = NEED_FREE_BYTES) -> None:
    """Fail at start, naming the disk, rather than let the kubelet evict the test's pods one by one."""
    free = shutil.disk_usage(path).free
    if free < need:
        raise NodeError(
            f"only {free / 2**30:.1f} GiB free on the disk of {path}; the real node needs "
            f"{need / 2**30:.0f} GiB (its kubelet evicts pods below {EVICTION_FREE}): free some space first"
        )


def apiserver_args() -> tuple[str, ...]:
    return APISERVER_ARGS


def free_subnet_octet() -> int:
    """An octet N whose 10.213.N.0/24 no route of this machine uses: a node's pod subnet chosen before the
    control plane starts, so that the API server's certificate can name the node's address
    (`RealNode(subnet_octet=N)`, `ControlPlane(extra_ip_sans=(node_address(N),))`)."""
    taken = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    free = [n for n in range(1, 251) if f"10.213.{n}." not in taken]
    return random.choice(free)


def node_address(octet: int) -> str:
    return f"10.213.{octet}.1"


def operator_values(node: RealNode, run_as_user: int = 1000650000) -> dict:
    """The chart's values that run the operator image on `node`: on the node's network (the test control
    plane's `kubernetes` Service is not routed: the operator dials the API server on 127.0.0.1), serving
    pods of the runtime image as an arbitrary uid, as OpenShift's restricted SCC assigns one."""
    repository, tag = images.pod_image("operator").rsplit(":", 1)
    return {
        "replicas": 1,
        "image": {"repository": repository, "tag": tag},
        "runtimeImage": images.pod_image("runtime"),
        "runtimePodSecurityContext": {"runAsUser": run_as_user},
        "hostNetwork": True,
        # a port free now rather than 8080: on the node's network the operator shares the host's ports with
        # every other test process
        "healthPort": free_port(),
        "extraEnv": [
            {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
            {"name": "KUBERNETES_SERVICE_PORT", "value": str(node.cp.ports["kube-apiserver"])},
        ],
        "resyncSeconds": 3,
    }


def host_volume(api_client, namespace: str, claim: str, folder: Path, size: str = "1Gi") -> str:
    """A PersistentVolume of a folder of this machine, bound to `claim` (made by the operator or the user;
    there is no provisioner here): group 0 may write it, as the arbitrary uid of the restricted profile runs
    in group 0. Returns the volume's name."""
    from kubernetes import client

    folder.mkdir(parents=True, exist_ok=True)
    os.chown(folder, 0, 0)
    folder.chmod(0o2770)
    name = f"{namespace}-{claim}"
    client.CoreV1Api(api_client).create_persistent_volume(
        {
            "metadata": {"name": name},
            "spec": {
                "capacity": {"storage": size},
                "accessModes": ["ReadWriteMany", "ReadWriteOnce", "ReadOnlyMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "hostPath": {"path": str(folder), "type": "Directory"},
                "claimRef": {"namespace": namespace, "name": claim},
            },
        }
    )
    return name


class RealNode:
    def __init__(
        self,
        cp: ControlPlane,
        workdir: Path,
        name: str = "spyre-kubelet-0",
        cards: int = 8,
        subnet_octet: int | None = None,
    ):
        self.cp = cp
        self.workdir = Path(workdir)
        self.name = name
        self.cards = cards
        self.procs: list[Proc] = []
        self.host: HostState | None = None
        self.plugin: TestDevicePlugin | None = None
        self.fixed_subnet = subnet_octet is not None
        self.subnet_octet = subnet_octet if subnet_octet is not None else random.randint(1, 250)
        self.relay: TcpRelay | None = None
        self.bridge = f"spyrebr{self.subnet_octet}"
        self.ready_seconds: float | None = None
        self._lock_fd: int | None = None
        self.restore_problems: list[str] = []

    # ---- addresses -------------------------------------------------------------------------------

    @property
    def node_ip(self) -> str:
        return node_address(self.subnet_octet)

    def api_server_for_pods(self) -> tuple[str, int]:
        """Where the node's pods reach the API server: a relay on the node's bridge address to the control
        plane's 127.0.0.1 (there is no kube-proxy to route the `kubernetes` Service). A pod verifies the API
        server's certificate, so the control plane must name this address (`ControlPlane(extra_ip_sans=)`).
        A pod is told by KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT in its env, as the operator's
        pod is (operator_values)."""
        if self.relay is None:
            self.relay = TcpRelay(self.node_ip, ("127.0.0.1", self.cp.ports["kube-apiserver"])).start()
        return self.relay.address

    @property
    def subnet(self) -> str:
        return f"10.213.{self.subnet_octet}.0/24"

    @property
    def socket_dir(self) -> Path:
        """containerd's sockets and the kubelet's root (its pod-resources socket), on a short path: a unix
        socket's path has at most 104 bytes, and a test folder under pytest-xdist is longer."""
        return Path(f"/tmp/spyre-node-{os.getpid()}-{self.subnet_octet}")

    @property
    def containerd_socket(self) -> Path:
        return self.socket_dir / "containerd.sock"

    # ---- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> RealNode:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 120.0) -> RealNode:
        t0 = time.monotonic()
        missing = missing_prerequisites()
        if missing:
            raise NodeError(
                "the real node needs tests/cluster/build-node.sh and build-images.sh first; missing: "
                + ", ".join(missing)
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.socket_dir.mkdir(parents=True, exist_ok=True)
        check_free_disk(self.workdir)
        self.take_lock()
        try:
            self.host = HostState.record()
            self._network()
            self.host.make_cgroup(self.cgroup_root.strip("/"))
            self._start_registry()
            self._start_containerd()
            self._start_kubelet()
            self._wait_registered(timeout)
            KUBELET_SOCKET_DIR.mkdir(parents=True, exist_ok=True)
            self.plugin = TestDevicePlugin(CARD_RESOURCE, self.cards).start()
            self._wait_cards(timeout)
        except BaseException:
            self.stop()
            raise
        self.ready_seconds = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """Pods first (the kubelet tears their sandboxes and networks down), then the processes, then what
        the node changed on the host. Problems restoring the host are kept in `restore_problems`."""
        with contextlib.suppress(Exception):
            self._drain_pods()
        if self.plugin is not None:
            self.plugin.stop()
            self.plugin = None
        if self.relay is not None:
            self.relay.stop()
            self.relay = None
        kubelet_ran = any(p.name == "kubelet" for p in self.procs)
        for proc in reversed(self.procs):
            terminate(proc, grace=15)
        self.procs.clear()
        if kubelet_ran:  # the node leaves the cluster: nothing may be scheduled onto it any more
            with contextlib.suppress(Exception):
                self._core().delete_node(self.name)
        self._kill_shims()
        if self.host is not None:
            self.host.kill_cgroup_processes()
            self.restore_problems = self.host.restore(self.workdir, self.socket_dir)
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            self.host = None
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        self._release_lock()

    # ---- steps -----------------------------------------------------------------------------------

    @property
    def cgroup_root(self) -> str:
        return f"/spyre-node-{self.subnet_octet}"

    def take_lock(self, timeout: float = 1800) -> None:
        """One real node per machine: the 1.20 kubelet's device-plugin socket has a fixed path. `start` takes
        it; a test that looks at the host before its node starts takes it first (another node may be up)."""
        if self._lock_fd is not None:
            return
        LOCK.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(LOCK, os.O_CREAT | os.O_RDWR, 0o644)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise NodeError(f"another real node holds {LOCK} for more than {timeout:.0f} s") from None
                time.sleep(1)
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _network(self) -> None:
        """The pods' bridge, with the node's address on it, made here (so the bridge plugin needs neither
        to be a gateway nor to turn on IP forwarding)."""
        taken = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
        if self.fixed_subnet and f"10.213.{self.subnet_octet}." in taken:
            raise NodeError(f"the node's subnet {self.subnet} is taken on this machine: {taken}")
        while f"10.213.{self.subnet_octet}." in taken:
            self.subnet_octet = random.randint(1, 250)
            self.bridge = f"spyrebr{self.subnet_octet}"
        for cmd in (
            ["ip", "link", "add", self.bridge, "type", "bridge"],
            ["ip", "addr", "add", f"{self.node_ip}/24", "dev", self.bridge],
            ["ip", "link", "set", self.bridge, "up"],
        ):
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode:
                raise NodeError(f"`{' '.join(cmd)}` failed: {res.stderr.strip()}")
        cni = self.workdir / "cni"
        cni.mkdir(parents=True, exist_ok=True)
        conf = {
            "cniVersion": "0.4.0",
            "name": "spyre-test",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.bridge,
                    "isGateway": False,
                    "ipMasq": False,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": str(self.workdir / "cni-ipam"),
                        "ranges": [[{"subnet": self.subnet, "rangeStart": f"10.213.{self.subnet_octet}.10"}]],
                        "routes": [],
                    },
                }
            ],
        }
        (cni / "10-spyre.conflist").write_text(json.dumps(conf, indent=2))

    def _spawn(self, name: str, argv: list[str]) -> Proc:
        log = self.workdir / f"{name}.log"
        with open(log, "ab") as out:
            try:
                popen = subprocess.Popen(
                    argv,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    cwd=self.workdir,
                    preexec_fn=_die_with_parent,
                )
            except OSError as e:
                raise NodeError(f"{name} could not be started ({argv[0]}): {e}") from e
        proc = Proc(name, popen.pid, log, popen)
        self.procs.append(proc)
        return proc

    def _wait(self, proc: Proc | None, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if proc is not None and not proc.is_alive():
                raise NodeError(
                    f"{proc.name} exited while waiting for {what}; last log lines:\n{tail(proc.log)}"
                )
            try:
                value = predicate()
                if value:
                    return value
            except Exception as e:  # not up yet
                last = e
            time.sleep(0.3)
        logs = "\n".join(f"--- {p.name}:\n{tail(p.log, 15)}" for p in self.procs)
        raise NodeError(f"timed out after {timeout:.0f} s waiting for {what} (last error: {last})\n{logs}")

    def _start_registry(self) -> None:
        import urllib.request

        self.registry_port = free_port()
        conf = self.workdir / "registry.yml"
        conf.write_text(
            json.dumps(
                {
                    "version": 0.1,
                    "log": {"level": "warn", "accesslog": {"disabled": True}},
                    "storage": {"filesystem": {"rootdirectory": str(images.registry_storage())}},
                    "http": {"addr": f"127.0.0.1:{self.registry_port}"},
                }
            )
        )
        proc = self._spawn("registry", ["docker-registry", "serve", str(conf)])
        url = f"http://127.0.0.1:{self.registry_port}/v2/"
        self._wait(proc, lambda: urllib.request.urlopen(url, timeout=2).status == 200, 30, "the registry")

    def _start_containerd(self) -> None:
        d = self.workdir / "containerd"
        hosts = d / "certs.d" / images.REGISTRY_HOST
        hosts.mkdir(parents=True, exist_ok=True)
        reg = f"http://127.0.0.1:{self.registry_port}"
        (hosts / "hosts.toml").write_text(
            f'server = "{reg}"\n\n[host."{reg}"]\n  capabilities = ["pull", "resolve"]\n'
        )
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        (d / "config.toml").write_text(
            f"""version = 2
root = "{d}/root"
state = "{d}/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "{self.containerd_socket}"
[ttrpc]
  address = "{self.containerd_socket}.ttrpc"
[{cri}]
  sandbox_image = "{images.pod_image("pause")}"
  restrict_oom_score_adj = true
  disable_apparmor = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        BinaryName = "{shutil.which("runc")}"
        SystemdCgroup = false
        Root = "{d}/runc"
  [{cri}.cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{self.workdir / "cni"}"
    max_conf_num = 1
  [{cri}.registry]
    config_path = "{d / "certs.d"}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"
"""
        )
        proc = self._spawn("containerd", ["containerd", "--config", str(d / "config.toml")])
        self._wait(proc, self.containerd_socket.exists, 60, "containerd's socket")

    def _start_kubelet(self) -> None:
        d = self.workdir / "kubelet"
        pki = self.cp.workdir / "pki"
        d.mkdir(parents=True, exist_ok=True)
        crt, key = issue_client_cert(
            pki, f"kubelet-{self.name}", f"system:node:{self.name}", ["system:nodes"]
        )
        kubeconfig = json.loads(
            kubeconfig_yaml(self.cp.server, pki / "ca.crt", "", f"system:node:{self.name}")
        )
        kubeconfig["users"][0]["user"] = {"client-certificate": str(crt), "client-key": str(key)}
        (d / "kubeconfig").write_text(json.dumps(kubeconfig, indent=2))
        self.kubelet_port, self.healthz_port = free_port(), free_port()
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": self.node_ip,
            "port": self.kubelet_port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.healthz_port,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": False},
                "x509": {"clientCAFile": str(pki / "ca.crt")},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroup_root,
            "cgroupsPerQOS": True,
            "makeIPTablesUtilChains": False,
            "failSwapOn": False,
            "evictionHard": {
                "memory.available": "100Mi",
                # absolute, not a share: on a large shared disk 2 % is gigabytes a test run may need
                "nodefs.available": EVICTION_FREE,
                "imagefs.available": EVICTION_FREE,
                "nodefs.inodesFree": "2%",
            },
            "imageGCHighThresholdPercent": 99,
            "imageGCLowThresholdPercent": 98,
            "volumePluginDir": str(d / "volume-plugins"),
            "nodeStatusUpdateFrequency": "4s",
            "syncFrequency": "5s",
            "serializeImagePulls": False,
        }
        (d / "config.yaml").write_text(json.dumps(config, indent=2))
        endpoint = f"unix://{self.containerd_socket}"
        labels = (
            f"ibm.com/spyre.present=true,ibm.com/spyre.product=IBM_Spyre,ibm.com/spyre.count={self.cards}"
        )
        self._spawn(
            "kubelet",
            [
                str(self.cp.bin_dir / "kubelet"),
                f"--config={d / 'config.yaml'}",
                f"--kubeconfig={d / 'kubeconfig'}",
                f"--root-dir={self.socket_dir / 'kubelet-root'}",  # its sockets need a short path
                f"--cert-dir={d / 'pki'}",
                "--container-runtime=remote",
                f"--container-runtime-endpoint={endpoint}",
                f"--image-service-endpoint={endpoint}",
                f"--pod-infra-container-image={images.pod_image('pause')}",
                f"--hostname-override={self.name}",
                f"--node-ip={self.node_ip}",
                f"--node-labels={labels}",
                "--v=2",
            ],
        )

    def _core(self):
        from kubernetes import client

        return client.CoreV1Api(self.cp.api_client())

    def _wait_registered(self, timeout: float) -> None:
        core = self._core()
        kubelet = next(p for p in self.procs if p.name == "kubelet")

        def ready():
            node = core.read_node(self.name)
            return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])

        self._wait(kubelet, ready, timeout, f"node {self.name} to register and be Ready")
        node = core.read_node(self.name)
        pressure = [
            c.type for c in node.status.conditions or [] if c.type.endswith("Pressure") and c.status == "True"
        ]
        if pressure:
            raise NodeError(f"node {self.name} reports {', '.join(pressure)}: its pods would be evicted")
        # no node lifecycle controller in the test control plane: nothing lifts the not-ready taint the
        # node was created with
        taints = node.spec.taints or []
        kept = [t.to_dict() for t in taints if t.key != "node.kubernetes.io/not-ready"]
        if len(kept) != len(taints):
            core.patch_node(self.name, {"spec": {"taints": kept or None}})

    def _wait_cards(self, timeout: float) -> None:
        core = self._core()
        kubelet = next(p for p in self.procs if p.name == "kubelet")

        def cards():
            alloc = core.read_node(self.name).status.allocatable or {}
            return alloc.get(CARD_RESOURCE) == str(self.cards)

        self._wait(kubelet, cards, timeout, f"{self.cards} {CARD_RESOURCE} allocatable on {self.name}")

    # ---- teardown --------------------------------------------------------------------------------

    def _drain_pods(self, timeout: float = 60) -> None:
        """Deletes every pod bound to this node and waits until containerd runs no task of theirs."""
        if not any(p.name == "kubelet" and p.is_alive() for p in self.procs):
            return
        core = self._core()
        # cordoned first: the pods' controllers (a Deployment, the operator) must not put new pods here
        with contextlib.suppress(Exception):
            core.patch_node(self.name, {"spec": {"unschedulable": True}})
        for pod in core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.name}").items:
            with contextlib.suppress(Exception):
                core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.tasks():
            time.sleep(1)

    def tasks(self) -> list[str]:
        res = subprocess.run(
            ["ctr", "--address", str(self.containerd_socket), "-n", "k8s.io", "tasks", "ls", "-q"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return res.stdout.split() if res.returncode == 0 else []

    def _kill_shims(self) -> None:
        """containerd's shims outlive it by design; the ones serving this node's containerd are stopped."""
        marker = str(self.containerd_socket).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"containerd-shim" in cmdline and marker in cmdline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(entry.name), signal.SIGKILL)
