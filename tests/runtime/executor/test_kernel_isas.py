"""The C++ kernels on the vector paths of the other CPUs Spyre ships with (issue 38: x86_64, s390x and
ppc64le). They are written once on ATen's portable vector layer (at::vec); every other test runs this
machine's AVX-512 path. Here the extension is built again, in a process whose ATen CPU capability is lowered
(ATEN_CPU_CAPABILITY, which `paged_attention.build_flags` follows): `default`, at::vec's generic path (vectors
of 8 floats, the width of VSX's and Z vector's, with no x86 intrinsic and no bfloat16 dot product), and
`avx2`. In that process the kernels' equality tables run against their ATen oracles: the paged decode, a
prompt piece's attention, the few-row linear and the SwiGLU op. About 40 s each, the build included."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
HERE = "tests/runtime/executor"
TABLES = (  # 1,649 cases: the tables of block layouts, rows, widths and dtypes (the dot product's off)
    f"{HERE}/test_paged_attention_kernel.py::test_kernel_equals_the_aten_ops",
    f"{HERE}/test_paged_prefill_kernel.py::test_the_kernel_equals_the_aten_path",
    f"{HERE}/test_linear_row.py::test_linear_row_equals_f_linear",
    f"{HERE}/test_packed_glu.py",
)


@pytest.mark.parametrize(("capability", "isa"), [("default", "scalar"), ("avx2", "avx2")])
def test_the_kernels_equal_their_oracles_on_a_narrower_vector_path(capability, isa, tmp_path):
    env = {
        **os.environ,
        "ATEN_CPU_CAPABILITY": capability,
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"),
        "PYTHONPATH": os.pathsep.join(str(REPO / p) for p in ("runtime", "contract", "operator", "")),
    }
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-x", *TABLES]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=840)
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) > 1600, tail
    assert "skipped" not in done.stdout.splitlines()[-1], tail  # on this path every case runs
    # the build that served them is the narrower path's own (its name says which), nothing else was built
    built = sorted(p.name for p in (tmp_path / "extensions").iterdir())
    assert built and all(f"spyre_paged_attention_{isa}_" in name for name in built), built
