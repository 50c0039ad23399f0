"""The C++ paged decode-attention kernel (paged_attention.cpp, op `spyre_kernels::paged_decode`): built from
the project's own source on first use, cached, with the ATen ops of kv_cache.py as its fallback and oracle.
The same extension holds the few-row linear (linear_row.cpp, `spyre_kernels::linear_row`), which linear.py
runs for a step of a few live rows (linear.row_limits()), with oneDNN's packed GEMM as its fallback and
oracle.

Why: kv_cache's ATen path copies every live row's KV blocks into a dense tensor (`index_select`), then SDPA
reads the copy again, three passes over the KV per layer; bench/README.md run 20 measured it at 35 % of a
32-row decode step. The kernel reads each row's blocks in place, once, through the block table.

Setting: SENDNN_INFERENCE_PAGED_ATTENTION_KERNEL, 1 (default) uses the extension wherever it builds, 0 keeps
the ATen ops (and oneDNN's GEMM for every row). Only the CPU backends call it (sendnn lowers its graphs
itself).

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
runtime image sets it beside TORCHINDUCTOR_CACHE_DIR. A finished build leaves a stamp (the source's and
our flags' hash); a process whose source matches it loads the library as it is, with no ninja, no
compiler and no import of inductor (0.25 s of CPU at each start, and a rebuild whenever another venv
had built it: ninja's build file names the venv's torch headers). Otherwise the build starts in a
background thread when the executor starts (`start_build`), so it overlaps loading the weights. Any
failure (no compiler, a compile error, an unsupported platform) logs one line and the ATen ops serve.

Narrowed builds: a whole build reads caches of every dtype (14.5 s of one core here, `python -m` below and
the runtime image build it). A server that finds none builds only its own dtypes' paths (`start_build`'s
model and cache dtypes; 9 s), into a folder of its own name (`_narrowed`), which `takes` then names the
limits of; a whole build, where there is one, serves every process.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from spyre_contract.environment import Env

log = logging.getLogger(__name__)

SETTING = "PAGED_ATTENTION_KERNEL"  # SENDNN_INFERENCE_PAGED_ATTENTION_KERNEL
SOURCE = Path(__file__).with_name("paged_attention.cpp")
# the extension's sources, built as one text (each after the other): the paged decode, the few-row linear
# (linear_row.cpp, `torch.ops.spyre_kernels.linear_row`, which linear.py runs for a few live rows),
# the C++ kernel of linear.py's packed linear op (packed_linear.cpp), which serves once linear.py has
# moved its state into it (`when_loaded`), and a prompt piece's attention (paged_prefill.cpp,
# `spyre_kernels.paged_prefill`, and in place in the region `paged_prefill_rows`, which kv_cache runs)
SOURCES = (
    SOURCE,
    *(SOURCE.with_name(name) for name in ("linear_row.cpp", "packed_linear.cpp", "paged_prefill.cpp")),
)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OWN_FLAGS = ["-O3", "-fopenmp", "-DNDEBUG"]
STAMP = "spyre-build.stamp"  # a finished build's fingerprint (`fingerprint`), beside its library
FLOCK = "spyre-build.flock"
# ATen's CPU capability -> inductor's name of that vector ISA and its class (torch._inductor.cpu_vec_isa)
ISAS = {
    "AVX512": ("avx512", "VecAVX512"),
    "AVX2": ("avx2", "VecAVX2"),
    "VSX": ("vsx", "VecVSX"),
    "ZVECTOR": ("zvector", "VecZVECTOR"),
}

_lock = threading.Lock()
_op: list = []  # [op or None] once the kernel has been tried (built and loaded, or not)
_row: list = []  # [the few-row linear op] once the extension is loaded
_prefill: list = []  # [a prompt piece's attention op] likewise
_off = 0  # > 0 within `disabled()`
_hooks: list[Callable[[], None]] = []  # run once the extension is loaded (`when_loaded`)
_hooks_lock = threading.Lock()
_want: list = []  # [(model dtype, cache dtype)] a server's dtypes (`start_build`), for a narrowed first build
_covers: set = set()  # (cache dtype, query dtype) pairs the loaded build reads (`takes`)


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


def takes(query: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether the attention kernels read `cache` under `query`: a cache of DTYPES, and a query of its dtype
    or a float32 query over a narrower cache (--kv-cache-dtype), where the loaded build holds that path. It
    waits for the build first, as `kernel()` does (what the loaded build reads is known only then)."""
    return kernel() is not None and (cache.dtype, query.dtype) in _covers


def covered(caches: tuple, mixed: bool) -> set:
    """The (cache dtype, query dtype) pairs a build of `caches` reads: each under its own dtype, and under a
    float32 query too where `mixed`."""
    return {(c, c) for c in caches} | ({(c, torch.float32) for c in caches} if mixed else set())


def _narrowed(model: torch.dtype, cache: torch.dtype) -> tuple[str, list[str], set]:
    """A build of one server's paths: its name, its -D flags (paged_attention.cpp's SPYRE_KERNEL_*) and the
    pairs it reads."""
    mixed = model == torch.float32 and cache != torch.float32
    flags = [f"-DSPYRE_KERNEL_CACHES={1 << DTYPES.index(cache)}", f"-DSPYRE_KERNEL_MIXED={int(mixed)}"]
    name = f"{extension_name()}_kv_{str(cache).removeprefix('torch.')}" + ("_q_float32" if mixed else "")
    return name, flags, covered((cache,), mixed)


def row_kernel():
    """The few-row linear op (`torch.ops.spyre_kernels.linear_row.default`), looked up once; None where
    `kernel()` is None (the setting off, within `disabled()`, or no build)."""
    return _row[0] if kernel() is not None else None


def prefill_kernel():
    """A prompt piece's attention op in place in the step's region (`spyre_kernels.paged_prefill_rows`,
    paged_prefill.cpp), looked up once; None where `kernel()` is None (off, `disabled()`, no build)."""
    return _prefill[0] if kernel() is not None else None


def start_build(
    model: torch.dtype | None = None, cache: torch.dtype | None = None
) -> threading.Thread | None:
    """Builds (or loads) the kernel in a background thread, so that a first build overlaps what the
    process does meanwhile; a forward that needs it first waits for it. None when already tried. `model`
    and `cache`: the dtypes this process runs, so that a first build compiles only their paths (a whole
    build, where there is one, serves instead)."""
    if _op:
        return None
    if model in DTYPES and cache in DTYPES and not _want:
        _want.append((model, cache))
    text = source_text()
    if any(_is_built(_directory(name), name, text, flags) for name, flags, _ in _builds()):
        kernel()  # loads in milliseconds, and needs none of the imports below
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


def when_loaded(hook: Callable[[], None]) -> None:
    """Runs `hook` once the extension is loaded (now, when it is): linear.py moves its state into the C++
    packed linear then. Never where the extension is off or does not build."""
    with _hooks_lock:  # not `_lock`, which a build holds for a minute
        if not _row:
            _hooks.append(hook)
            return
    hook()


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within: `kernel()` is None, so kv_cache's paged decode runs its ATen ops, and the packed linear
    oneDNN's GEMM for every row (the tests' oracle)."""
    global _off
    _off += 1
    _tell_row()
    try:
        yield
    finally:
        _off -= 1
        _tell_row()


def _tell_row() -> None:
    """The C++ packed linear may run the few-row linear only outside `disabled()`."""
    if _row:
        torch.ops.spyre_kernels.set_row(_off == 0)


def extension_name() -> str:
    """The extension's name: its source's, this CPU's vector ISA's and torch's version's."""
    isa = ISAS.get(torch.backends.cpu.get_cpu_capability(), ("scalar",))[0]
    python = f"py{sys.version_info[0]}{sys.version_info[1]}"
    return re.sub(r"\W", "_", f"spyre_paged_attention_{isa}_torch{torch.__version__}_{python}")


def source_text() -> str:
    """The extension's source: its files one after the other (a single translation unit)."""
    return "\n".join(path.read_text() for path in SOURCES)


def fingerprint(text: str, defines: tuple | list = ()) -> str:
    """What a build is made of beyond its name (the ISA, hence inductor's flags for it, and torch's version):
    the source text and our own flags."""
    return hashlib.sha256("\0".join([text, *OWN_FLAGS, *defines]).encode()).hexdigest()


def build_flags() -> list[str]:
    """The compiler flags: inductor's for this CPU's vector ISA, -O3 and OpenMP."""
    isa = _vec_isa()
    flags = list(OWN_FLAGS)
    if isa is not None:
        flags += [f"-D{macro}" for macro in isa.build_macro()] + isa.build_arch_flags().split()
    return flags


def _vec_isa():
    """Inductor's description of the vector ISA that ATen itself dispatches to on this CPU
    (`torch.backends.cpu.get_cpu_capability`, which ATEN_CPU_CAPABILITY can lower), without inductor's
    trial compiles; None (at::vec's scalar path) where at::vec has no path of its own."""
    from torch._inductor import cpu_vec_isa

    isa = ISAS.get(torch.backends.cpu.get_cpu_capability())
    return getattr(cpu_vec_isa, isa[1])() if isa else None


def _directory(name: str | None = None) -> Path:
    """TORCH_EXTENSIONS_DIR/<name>, else torch's default root (cpp_extension.get_default_build_root's)."""
    import torch._appdirs

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.realpath(
        torch._appdirs.user_cache_dir(appname="torch_extensions")
    )
    return Path(root) / (name or extension_name())


def _builds() -> list[tuple[str, list[str], set]]:
    """The builds this process may load, the whole one first, and a narrowed one for a server's dtypes
    (`start_build`): (name, -D flags, the pairs it reads)."""
    whole = (extension_name(), [], covered(DTYPES, True))
    return [whole, _narrowed(*_want[0])] if _want else [whole]


def _is_built(directory: Path, name: str, text: str, defines: tuple | list = ()) -> bool:
    """The folder holds a finished build of `text` (its stamp says so)."""
    try:
        stamp = (directory / STAMP).read_text()
        return stamp == fingerprint(text, defines) and (directory / f"{name}.so").is_file()
    except OSError:
        return False


def load_built(directory: Path, name: str, text: str, defines: tuple | list = ()) -> bool:
    """Loads the build in `directory` when it is a finished build of `text`; False otherwise. Under a shared
    flock, so never while a builder rewrites it; the lock file is opened read-only, so a read-only folder
    (the image's prebuilt kernel under the restricted profile's read-only root filesystem) loads too."""
    try:
        held = open(directory / FLOCK)  # noqa: SIM115
    except OSError:
        held = None
    with held or contextlib.nullcontext():
        if held is not None:
            fcntl.flock(held, fcntl.LOCK_SH)
        if not _is_built(directory, name, text, defines):
            return False
        torch.ops.load_library(str(directory / f"{name}.so"))
        return True


def _choose(text: str) -> tuple[str, list[str], set, bool]:
    """The build to load, its flags, the pairs it reads, and whether it is finished and loaded: the first
    finished one of `_builds()`; else the narrowest, or the whole one where its folder holds a library
    without a stamp that nobody may rebuild (a read-only image built before stamps)."""
    builds = _builds()
    for name, defines, pairs in builds:
        if load_built(_directory(name), name, text, defines):
            return name, defines, pairs, True
    name, defines, pairs = builds[0]
    folder = _directory(name)
    if (folder / f"{name}.so").is_file() and not os.access(folder, os.W_OK):
        return name, defines, pairs, False
    return (*builds[-1], False)


def _load():
    started = time.monotonic()
    try:
        text = source_text()
        name, defines, pairs, loaded = _choose(text)
        directory = _directory(name)
        if not loaded:
            directory.mkdir(parents=True, exist_ok=True)
            try:
                held = open(directory / FLOCK, "a")  # noqa: SIM115
            except OSError:
                # a folder nobody may write, with no stamp (an image built before stamps): loaded as it is,
                # never built (cpp_extension.load writes its lock there)
                torch.ops.load_library(str(directory / f"{name}.so"))
            else:
                with held:
                    _build_under(held, directory, name, text, defines)
        _covers.update(pairs)
        op = torch.ops.spyre_kernels.paged_decode.default
        torch.library.register_fake("spyre_kernels::paged_decode")(_fake_decode)
        with _hooks_lock:
            _row.append(torch.ops.spyre_kernels.linear_row.default)
            _prefill.append(torch.ops.spyre_kernels.paged_prefill_rows.default)
            hooks = list(_hooks)
            _hooks.clear()
        _tell_row()
        for hook in hooks:
            hook()
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


def _build_under(held, directory: Path, name: str, text: str, defines: tuple | list = ()) -> None:
    """Builds (or loads the cached build of) the kernel holding `held`'s flock: builders of this code hold
    it (the kernel drops it when one dies); torch's own `lock` file, which it waits on forever, is then a
    dead builder's leftover."""
    fcntl.flock(held, fcntl.LOCK_EX)
    (directory / "lock").unlink(missing_ok=True)
    compile_extension(name, text, directory, defines)


def compile_extension(name: str, text: str, directory: Path, defines: tuple | list = ()) -> None:
    """Builds the C++ `text` as the extension `name` in `directory` with this CPU's flags, or loads the build
    there when it is current: the runtime's kernel, and the versions of it bench/kernel_ab.py compares.

    The build reads a copy of the source kept in `directory` (rewritten only when the text changes), never the
    file it came from: ninja's build file names the source's path, so a build from another checkout or venv
    of the same source (a test clone beside a working tree, two venvs sharing ~/.cache) rebuilt it each time
    the path changed (20 s of compiling on a 2-core machine). The stamp goes while it builds and comes back
    once the library is whole. `defines`: -D flags of a narrowed build (`_narrowed`)."""
    from torch.utils import cpp_extension

    # (another builder finished it meanwhile, or another venv built it)
    if _is_built(directory, name, text, defines):
        torch.ops.load_library(str(directory / f"{name}.so"))
        return
    source = directory / "kernel.cpp"
    if not source.is_file() or source.read_text() != text:  # (a new mtime alone would make ninja rebuild)
        source.write_text(text)
    (directory / STAMP).unlink(missing_ok=True)
    _ninja_on_path()
    cpp_extension.load(
        name=name,
        sources=[str(source)],
        extra_cflags=build_flags() + list(defines),
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )
    (directory / STAMP).write_text(fingerprint(text, defines))


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
