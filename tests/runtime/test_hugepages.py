"""Transparent huge pages for torch's large allocations (spyre_runtime/hugepages.py): the runtime's processes
turn PyTorch's switch on before torch is imported, a bad value stops start-up with one line, and whether the
pages really are huge is measured in the process, not assumed."""

import os
import subprocess
import sys

import pytest
from spyre_contract import ContractError
from spyre_runtime import hugepages

from tests.runtime.test_cli import cli


@pytest.mark.parametrize(
    ("given", "kept"),
    [(None, "1"), ("1", "1"), ("0", "0")],
)
def test_the_switch_is_on_unless_set_to_off(given, kept):
    environ = {} if given is None else {hugepages.VARIABLE: given}
    assert hugepages.enable(environ) == kept
    assert environ[hugepages.VARIABLE] == kept


@pytest.mark.parametrize("bad", ["yes", "true", "", " 1", "2"])
def test_any_other_value_is_an_error_naming_it(bad):
    with pytest.raises(ContractError, match=f"THP_MEM_ALLOC_ENABLE={bad!r}: must be 1"):
        hugepages.enable({hugepages.VARIABLE: bad})


def test_the_cli_stops_on_a_bad_value_with_one_line(tmp_path):
    res = cli("tiny-model", str(tmp_path / "m"), env={hugepages.VARIABLE: "yes"})
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "spyre-runtime: error: THP_MEM_ALLOC_ENABLE='yes': must be 1 (torch's allocations of 2 MiB and more "
        "on transparent huge pages, the default) or 0 (4 KiB pages)"
    ]
    assert not (tmp_path / "m").exists()  # nothing was written


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never\n", "always"),
        ("always madvise [never]\n", "never"),
        ("", "unknown"),
    ],
)
def test_the_kernels_mode_is_the_bracketed_word(text, mode):
    assert hugepages.mode(text) == mode


def test_the_processs_huge_pages_come_from_its_rollup():
    rollup = "Rss:              812 kB\nAnonHugePages:     4096 kB\nShmemPmdMapped:        0 kB\n"
    assert hugepages.anon_huge_kib(rollup) == 4096
    assert hugepages.anon_huge_kib("Rss: 812 kB\n") is None


PROBE = (
    "from spyre_runtime import hugepages\n"
    "hugepages.enable()\n"
    "import torch\n"
    "print(hugepages.torch_allocates_huge(), hugepages.describe(), sep='|')\n"
)


def probe(value):
    env = {k: v for k, v in os.environ.items() if k != hugepages.VARIABLE}
    if value is not None:
        env[hugepages.VARIABLE] = value
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    taken, line = out.stdout.strip().split("|")
    return taken == "True", line


def test_a_runtime_process_allocates_on_huge_pages_where_the_kernel_grants_them():
    """As the runtime's processes start (cli.main): the switch set before torch is imported. On this
    project's machines the kernel's mode is `madvise`: on by default, off with THP_MEM_ALLOC_ENABLE=0."""
    mode = hugepages.mode()
    on, line = probe(None)
    assert on == (mode in ("always", "madvise"))
    assert line == (
        f"transparent huge pages for torch's large allocations: {'on' if on else 'off'} "
        f"(THP_MEM_ALLOC_ENABLE=1, kernel THP mode {mode})"
    )
    off, line = probe("0")
    if mode != "always":  # `always` gives huge pages to large allocations without asking
        assert not off and line.endswith(f"off (THP_MEM_ALLOC_ENABLE=0, kernel THP mode {mode})")
