"""What a real node changes on the machine, recorded before it starts and put back when it stops (issue 34):
the sysctls the kubelet and the CNI bridge set, the iptables rules, the mounts, the cgroups, the folders the
1.20 kubelet and containerd create at fixed paths, and the processes left in the node's cgroups.

Test infrastructure, never shipped.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

# the kubelet's setupKernelTunables (kubelet 1.20 container_manager_linux.go) and what a bridge or a pod may
# turn on; each is put back to the value it had
SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
    "net/ipv4/ip_forward",
    "net/ipv4/conf/all/forwarding",
    "net/bridge/bridge-nf-call-iptables",
)
# folders at fixed paths: the 1.20 kubelet's device-plugin socket folder, pod and container logs;
# containerd's shim sockets; CRI's network namespaces
FIXED_PATHS = (
    Path("/var/lib/kubelet"),
    Path("/var/log/pods"),
    Path("/var/log/containers"),
    Path("/run/containerd"),
    Path("/run/netns"),
)
CGROUP_ROOT = Path("/sys/fs/cgroup")


def mount_points() -> list[str]:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        points.append(line.split()[4].replace("\\040", " "))
    return points


def _iptables_save() -> dict[str, str]:
    saved = {}
    for tool in ("iptables-save", "ip6tables-save"):
        if shutil.which(tool):
            res = subprocess.run([tool], capture_output=True, text=True)
            if res.returncode == 0:
                # counters and the dump's comment lines change on their own
                saved[tool] = "\n".join(
                    line.split(" [")[0] if line.startswith(":") else line
                    for line in res.stdout.splitlines()
                    if not line.startswith("#")
                )
    return saved


def cgroup_hierarchies() -> list[Path]:
    """The cgroup v1 hierarchies mounted under /sys/fs/cgroup (cpu,cpuacct aliases counted once)."""
    seen, found = set(), []
    for path in sorted(CGROUP_ROOT.iterdir()) if CGROUP_ROOT.is_dir() else []:
        if path.is_symlink() or not path.is_dir() or path.name == "unified":
            continue
        real = path.resolve()
        if real not in seen:
            seen.add(real)
            found.append(path)
    return found


@dataclass
class HostState:
    """Snapshot first (`record`), then `restore`: every step of restore runs even when another fails, and
    the failures are returned as text (a test reports them; nothing is left silently)."""

    sysctls: dict[str, str] = field(default_factory=dict)
    iptables: dict[str, str] = field(default_factory=dict)
    mounts: set[str] = field(default_factory=set)
    existing: dict[Path, set[str] | None] = field(default_factory=dict)
    cgroups: list[Path] = field(default_factory=list)

    @classmethod
    def record(cls) -> HostState:
        state = cls()
        for name in SYSCTLS:
            with contextlib.suppress(OSError):
                state.sysctls[name] = Path("/proc/sys", name).read_text().strip()
        state.iptables = _iptables_save()
        state.mounts = set(mount_points())
        for path in FIXED_PATHS:
            state.existing[path] = set(os.listdir(path)) if path.is_dir() else None
        return state

    def make_cgroup(self, name: str) -> None:
        """Creates /NAME in every v1 hierarchy (the kubelet's cgroupRoot must exist in each)."""
        for hierarchy in cgroup_hierarchies():
            path = hierarchy / name
            path.mkdir(exist_ok=True)
            self.cgroups.append(path)
            if (hierarchy / "cpuset.cpus").exists():
                for knob in ("cpuset.cpus", "cpuset.mems"):
                    (path / knob).write_text((hierarchy / knob).read_text())

    # ---- restore ---------------------------------------------------------------------------------

    def kill_cgroup_processes(self) -> list[int]:
        """SIGKILLs every process still in the node's cgroups (containers whose shim is gone)."""
        killed = []
        for top in self.cgroups:
            for procs in top.rglob("cgroup.procs") if top.is_dir() else []:
                with contextlib.suppress(OSError):
                    for pid in procs.read_text().split():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(pid), signal.SIGKILL)
                            killed.append(int(pid))
        return killed

    def restore(self, *workdirs: Path) -> list[str]:
        problems: list[str] = []
        for step in (
            lambda: self._unmount(workdirs),
            self._remove_cgroups,
            self._restore_sysctls,
            self._restore_iptables,
            self._remove_fixed_paths,
        ):
            try:
                problems += step()
            except Exception as e:  # every step runs; each failure is reported
                problems.append(f"{getattr(step, '__name__', 'restore step')}: {e}")
        return problems

    def _unmount(self, workdirs: tuple[Path, ...]) -> list[str]:
        owned = [*(str(w) for w in workdirs), *(str(p) for p in FIXED_PATHS)]
        new = [m for m in mount_points() if m not in self.mounts and any(m.startswith(o) for o in owned)]
        problems = []
        for point in sorted(set(new), key=len, reverse=True):
            res = subprocess.run(["umount", "-l", point], capture_output=True, text=True)
            if res.returncode and point in mount_points():
                problems.append(f"could not unmount {point}: {res.stderr.strip()}")
        return problems

    def _remove_cgroups(self) -> list[str]:
        self.kill_cgroup_processes()
        problems = []
        for top in self.cgroups:
            if not top.is_dir():
                continue
            for path in sorted(
                (p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True
            ):
                _rmdir_cgroup(path)
            if not _rmdir_cgroup(top):
                problems.append(f"cgroup {top} could not be removed")
        unified = CGROUP_ROOT / "unified"
        for top in {unified / t.name for t in self.cgroups} if unified.is_dir() else ():
            if top.is_dir():
                for path in sorted(top.rglob("*"), key=lambda p: len(p.parts), reverse=True):
                    if path.is_dir():
                        _rmdir_cgroup(path)
                _rmdir_cgroup(top)
        return problems

    def _restore_sysctls(self) -> list[str]:
        problems = []
        for name, value in self.sysctls.items():
            path = Path("/proc/sys", name)
            try:
                if path.read_text().strip() != value:
                    path.write_text(value)
            except OSError as e:
                problems.append(f"sysctl {name} could not be put back to {value}: {e}")
        return problems

    def _restore_iptables(self) -> list[str]:
        now = _iptables_save()
        problems = []
        for tool, before in self.iptables.items():
            if now.get(tool) != before:
                restore = tool.replace("-save", "-restore")
                res = subprocess.run([restore], input=before + "\n", capture_output=True, text=True)
                if res.returncode:
                    problems.append(f"{restore} failed: {res.stderr.strip()}")
        return problems

    def _remove_fixed_paths(self) -> list[str]:
        for path, before in self.existing.items():
            if not path.is_dir():
                continue
            if before is None:
                shutil.rmtree(path, ignore_errors=True)
                continue
            for name in set(os.listdir(path)) - before:
                target = path / name
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target, ignore_errors=True)
                else:
                    target.unlink(missing_ok=True)
        return []


def _rmdir_cgroup(path: Path, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
