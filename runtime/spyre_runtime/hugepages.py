"""Transparent huge pages for torch's large CPU allocations: the weights, their packed copies and panels, and
the KV cache.

A decode step of a few rows reads every weight once from memory; on 4 KiB pages the CPU's prefetchers stop at
each page's end, and a read of SmolLM2's float32 weights ran at 24.6-26.0 GB/s where the same read on 2 MiB
pages ran at 34.2-34.3 (bench/README.md run 53, a Zen 4). PyTorch has the switch: with THP_MEM_ALLOC_ENABLE=1
its CPU allocator aligns every allocation of 2 MiB or more to 2 MiB and asks the kernel for huge pages there
(madvise), which the kernel grants when /sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise`
(`never`: nothing changes). The allocator reads the variable once, at its first allocation, so `enable` runs
before torch is imported (cli.main): the runtime's processes, its tensor-parallel workers (which inherit the
environment) and the benches. THP_MEM_ALLOC_ENABLE=0 keeps 4 KiB pages.

Whether it took effect is measured, not assumed (`torch_allocates_huge`), and the start-up log says so
(`describe`, from the model executor)."""

from __future__ import annotations

import functools
import os
import re
from collections.abc import MutableMapping
from pathlib import Path

from spyre_contract import ContractError

VARIABLE = "THP_MEM_ALLOC_ENABLE"  # PyTorch's (c10's CPU allocator)
SYSFS = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ROLLUP = Path("/proc/self/smaps_rollup")
PROBE_BYTES = 8 << 20  # what `torch_allocates_huge` allocates and writes


def enable(environ: MutableMapping[str, str] | None = None) -> str:
    """Sets THP_MEM_ALLOC_ENABLE=1 where it is unset; returns its value. Anything but 0 or 1 is an error
    naming the variable (PyTorch would take it silently as off). Effective only before torch is imported."""
    environ = os.environ if environ is None else environ
    value = environ.setdefault(VARIABLE, "1")
    if value not in ("0", "1"):
        raise ContractError(
            f"{VARIABLE}={value!r}: must be 1 (torch's allocations of 2 MiB and more on transparent huge "
            "pages, the default) or 0 (4 KiB pages)"
        )
    return value


def mode(text: str | None = None) -> str:
    """The kernel's THP mode, the bracketed word of /sys/kernel/mm/transparent_hugepage/enabled (`always`,
    `madvise`, `never`), or `unknown` where it cannot be read (not Linux, or no THP)."""
    if text is None:
        try:
            text = SYSFS.read_text()
        except OSError:
            return "unknown"
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else "unknown"


def anon_huge_kib(text: str | None = None) -> int | None:
    """This process's anonymous memory on huge pages (AnonHugePages of /proc/self/smaps_rollup), in KiB;
    None where it cannot be read."""
    if text is None:
        try:
            text = ROLLUP.read_text()
        except OSError:
            return None
    found = re.search(r"^AnonHugePages:\s+(\d+) kB", text, re.MULTILINE)
    return int(found.group(1)) if found else None


@functools.cache
def torch_allocates_huge() -> bool:
    """Whether torch's large CPU allocations land on huge pages in this process: a probe of 8 MiB is allocated
    and written, and the process's AnonHugePages must grow by at least 2 MiB meanwhile. Measured once."""
    import torch

    before = anon_huge_kib()
    if before is None:
        return False
    probe = torch.ones(PROBE_BYTES, dtype=torch.uint8)
    after = anon_huge_kib()
    del probe
    return after is not None and after - before >= 2048


def describe() -> str:
    """One line for the start-up log: the setting, the kernel's mode, and whether it took effect."""
    taken = "on" if torch_allocates_huge() else "off"
    return (
        f"transparent huge pages for torch's large allocations: {taken} "
        f"({VARIABLE}={os.environ.get(VARIABLE, 'unset')}, kernel THP mode {mode()})"
    )
