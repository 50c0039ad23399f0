"""The C++ paged decode-attention kernel (paged_attention.cpp, op `spyre_kernels::paged_decode`): built from
the project's own source on first use, cached, with the ATen ops of kv_cache.py as its fallback and oracle.

Why: kv_cache's ATen path copies every live row's KV blocks into a dense tensor (`index_select`), then SDPA
reads the copy again, three passes over the KV per layer; bench/README.md run 20 measured it at 35 % of a
32-row decode step. The kernel reads each row's blocks in place, once, through the block table.

Setting: SENDNN_INFERENCE_PAGED_ATTENTION_KERNEL, 1 (default) uses the kernel wherever it builds, 0 keeps the
ATen ops. Only the CPU backends' paged decode calls it (sendnn lowers the static twin itself).

Build: `torch.utils.cpp_extension.load`, for the vector ISA that ATen dispatches to on this CPU, with
inductor's macro and flags for it (the CPU_CAPABILITY_* macro selects at::vec's AVX2, AVX-512, VSX or Z
vector path, the flags the compiler's; another CPU gets at::vec's portable scalar path), -O3 and OpenMP
(torch's own parallel backend, whose libgomp the process already holds). It needs what inductor already
needs, a C++ compiler, and ninja (the `ninja` wheel, a runtime dependency). The extension's name carries
the ISA and torch's version, so hosts with different CPUs that share a cache directory never load each
other's build.

Cache: TORCH_EXTENSIONS_DIR/<name> (torch's variable; unset: torch's user cache, `torch_extensions` under
XDG_CACHE_HOME or ~/.cache), built from a copy of the source kept there (so every checkout of the same
source shares one build), under a flock so that a builder killed mid-build blocks nobody; the
runtime image sets it beside TORCHINDUCTOR_CACHE_DIR. The build starts in a background thread when the
executor starts (`start_build`), so it overlaps loading the
weights; a cached build loads in well under a second. Any failure (no compiler, a compile error, an
unsupported platform) logs one line and the ATen ops serve.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from spyre_contract.environment import Env

log = logging.getLogger(__name__)

SETTING = "PAGED_ATTENTION_KERNEL"  # SENDNN_INFERENCE_PAGED_ATTENTION_KERNEL
SOURCE = Path(__file__).with_name("paged_attention.cpp")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_lock = threading.Lock()
_op: list = []  # [op or None] once the kernel has been tried (built and loaded, or not)
_off = 0  # > 0 within `disabled()`


def kernel():
    """The kernel op (`torch.ops.spyre_kernels.paged_decode.default`), built on the first call; None when
    the setting is off, within `disabled()`, or when it did not build."""
    if _off:
        return None
    if not _op:
        with _lock:
            if not _op:
                _op.append(_load() if Env().bool(SETTING, True) else None)
    return _op[0]


def start_build() -> threading.Thread | None:
    """Builds (or loads) the kernel in a background thread, so that a first build overlaps what the
    process does meanwhile; a forward that needs it first waits for it. None when already tried."""
    if _op:
        return None
    # the build's imports, on the caller's thread first: two threads importing torch._dynamo and
    # torch._inductor at once can each see the other's modules partially initialized (a server's start-up
    # failed on it: "cannot import name 'IndentedBuffer' from partially initialized module")
    import torch._dynamo
    import torch._inductor.codecache
    import torch._inductor.cpp_builder  # noqa: F401
    from torch._inductor import cpu_vec_isa  # noqa: F401
    from torch.utils import _filelock, cpp_extension  # noqa: F401

    thread = threading.Thread(target=kernel, name="paged-attention-build", daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within: `kernel()` is None, so kv_cache's paged decode runs its ATen ops (the tests' oracle)."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def extension_name() -> str:
    """The extension's name: its source's, this CPU's vector ISA's and torch's version's."""
    isa = _vec_isa()  # (never truth-tested: inductor's VecISA does a trial compile for that)
    python = f"py{sys.version_info[0]}{sys.version_info[1]}"
    name = f"spyre_paged_attention_{'scalar' if isa is None else isa}_torch{torch.__version__}_{python}"
    return re.sub(r"\W", "_", name)


def build_flags() -> list[str]:
    """The compiler flags: inductor's for this CPU's vector ISA, -O3 and OpenMP."""
    isa = _vec_isa()
    flags = ["-O3", "-fopenmp", "-DNDEBUG"]
    if isa is not None:
        flags += [f"-D{macro}" for macro in isa.build_macro()] + isa.build_arch_flags().split()
    return flags


def _vec_isa():
    """Inductor's description of the vector ISA that ATen itself dispatches to on this CPU
    (`torch.backends.cpu.get_cpu_capability`, which ATEN_CPU_CAPABILITY can lower), without inductor's
    trial compiles; None (at::vec's scalar path) where at::vec has no path of its own."""
    from torch._inductor import cpu_vec_isa

    names = {"AVX512": "VecAVX512", "AVX2": "VecAVX2", "VSX": "VecVSX", "ZVECTOR": "VecZVECTOR"}
    name = names.get(torch.backends.cpu.get_cpu_capability())
    return getattr(cpu_vec_isa, name)() if name else None


def _load():
    from torch.utils import cpp_extension

    started = time.monotonic()
    try:
        name = extension_name()
        root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
        directory = Path(root) / name
        directory.mkdir(parents=True, exist_ok=True)
        try:
            held = open(directory / "spyre-build.flock", "a")  # noqa: SIM115
        except OSError:
            # a folder nobody may write: the image's prebuilt kernel under a read-only root filesystem (the
            # restricted profile's): loaded as it is, never built (cpp_extension.load writes its lock there)
            torch.ops.load_library(str(directory / f"{name}.so"))
        else:
            with held:
                _build_under(held, directory, name)
        op = torch.ops.spyre_kernels.paged_decode.default
        torch.library.register_fake("spyre_kernels::paged_decode")(_fake_decode)
    except Exception as exc:  # any failure to build or load: the ATen ops serve
        log.warning(
            "Paged attention kernel unavailable, the ATen ops serve (%s: %s)",
            type(exc).__name__,
            _one_line(exc),
        )
        log.debug("Paged attention kernel build output:\n%s", exc)
        return None
    log.info("Paged attention kernel %s ready in %.1f s", name, time.monotonic() - started)
    return op


def _build_under(held, directory: Path, name: str) -> None:
    """Builds (or loads the cached build of) the kernel holding `held`'s flock: builders of this code hold
    it (the kernel drops it when one dies); torch's own `lock` file, which it waits on forever, is then a
    dead builder's leftover."""
    fcntl.flock(held, fcntl.LOCK_EX)
    (directory / "lock").unlink(missing_ok=True)
    compile_extension(name, SOURCE.read_text(), directory)


def compile_extension(name: str, text: str, directory: Path) -> None:
    """Builds the C++ `text` as the extension `name` in `directory` with this CPU's flags, or loads the build
    there when it is current: the runtime's kernel, and the versions of it bench/kernel_ab.py compares.

    The build reads a copy of the source kept in `directory` (rewritten only when the text changes), never the
    file it came from: ninja's build file names the source's path, so a build from another checkout or venv
    of the same source (a test clone beside a working tree, two venvs sharing ~/.cache) rebuilt it each time
    the path changed (20 s of compiling on a 2-core machine)."""
    from torch.utils import cpp_extension

    source = directory / "kernel.cpp"
    if not source.is_file() or source.read_text() != text:  # (a new mtime alone would make ninja rebuild)
        source.write_text(text)
    _ninja_on_path()
    cpp_extension.load(
        name=name,
        sources=[str(source)],
        extra_cflags=build_flags(),
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )


def _one_line(exc: Exception) -> str:
    """The first error line of a failed build (the compiler's, or the shell's when there is no compiler),
    skipping the echoed command lines; else the message's first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    short = [line for line in lines if len(line) < 300 and not line.startswith(("[", "FAILED", "ninja:"))]
    errors = [line for line in short if "error" in line.lower() or "not found" in line]
    return (errors or short or lines or [""])[0][:300]


def _ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the `ninja` wheel's binary sits beside the interpreter's
    scripts, which PATH lacks when the venv's python runs without activation."""
    with contextlib.suppress(ImportError):
        import ninja

        path = os.environ.get("PATH", "")
        if ninja.BIN_DIR not in path.split(os.pathsep):
            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR


def _fake_decode(query, *_):
    return torch.empty_like(query)


if __name__ == "__main__":  # builds the kernel into TORCH_EXTENSIONS_DIR (the runtime image does, once)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(0 if kernel() is not None else 1)
