"""The compiled-graph cache on a shared volume (TORCH_SENDNN_CACHE_ENABLE=1, TORCH_SENDNN_CACHE_DIR).

Layout of the cache directory (many replicas, on many hosts, may share it):

    entries/<key>/files...        one published entry: torch's compile caches for one configuration
    entries/<key>/manifest.json   every file with its size and sha256, written last
    tmp/<key>.<pid>.<random>/     an entry being written; published by one atomic rename into entries/
    locks/<key>.lock              held (flock) while a process looks up, compiles and publishes <key>
    load-slots/slot-<i>.lock      SENDNN_INFERENCE_MAX_LOAD_PROCESSES: a file-lock semaphore
    catalog.json                  key, configuration, size, created, last used of every entry

The key digests everything that changes the graphs (graph_key.py). With `inductor`, an entry is the whole
inductor cache directory of the compiling process (FX graphs, AOTAutograd entries and the compiled kernels),
so a warm start loads kernels instead of compiling them. A reader verifies the manifest and copies the entry
into a private directory before torch sees it, so nobody writes into a published entry. A process killed
mid-write leaves only a tmp/ directory that no reader looks at; a corrupt or truncated entry fails the
manifest check, is logged, moved to corrupt/ and rebuilt. With `sendnn`, torch_sendnn reads the same two
variables and keeps its own cache; the entry is then a marker (manifest, no files) so strict mode works.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from spyre_runtime.config import ConfigError, RuntimeConfig
from spyre_runtime.executor.graph_key import _sha256_file, cache_configuration, cache_key

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


# ---- locks ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive flock; the kernel drops it when the holder dies, so a killed process blocks nobody."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def load_slot(slots_dir: Path, num_slots: int, poll_seconds: float = 0.2) -> Iterator[int | None]:
    """At most `num_slots` holders at once across processes (0: no limit). Yields the slot taken."""
    if num_slots <= 0:
        yield None
        return
    slots_dir.mkdir(parents=True, exist_ok=True)
    waited = False
    while True:
        for i in range(num_slots):
            f = (slots_dir / f"slot-{i}.lock").open("a")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            try:
                yield i
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
                f.close()
            return
        if not waited:
            log.info("Waiting for one of %d load slots in %s", num_slots, slots_dir)
            waited = True
        time.sleep(poll_seconds)


def loading(config: RuntimeConfig):
    """Wraps loading a model, and compiling: at most SENDNN_INFERENCE_MAX_LOAD_PROCESSES processes at once,
    counted on the shared cache directory when there is one, else on this host's temporary directory.
    Nobody may wait on another rank while holding a slot (see ModelExecutor's barrier)."""
    if config.cache_enabled and config.cache_dir is not None:
        slots = config.cache_dir / "load-slots"
    else:
        slots = Path(tempfile.gettempdir()) / "spyre-serve-load-slots"
    return load_slot(slots, config.max_load_processes)


# ---- entries -------------------------------------------------------------------------------------


@dataclass
class GraphCache:
    root: Path
    key: str
    configuration: dict

    @property
    def entry(self) -> Path:
        return self.root / "entries" / self.key

    def lock(self):
        return file_lock(self.root / "locks" / f"{self.key}.lock")

    def is_valid(self) -> bool:
        """The entry exists and every file matches its manifest. A corrupt entry is moved aside."""
        if not self.entry.is_dir():
            return False
        problem = self._check()
        if problem is None:
            return True
        log.warning("Graph cache entry %s is corrupt (%s); ignoring it and rebuilding", self.key, problem)
        aside = self.root / "corrupt" / f"{self.key}.{int(time.time())}.{uuid.uuid4().hex[:6]}"
        aside.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            self.entry.rename(aside)
        return False

    def _check(self) -> str | None:
        try:
            manifest = json.loads((self.entry / MANIFEST).read_text())
            files = manifest["files"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"unreadable manifest: {e}"
        if manifest.get("key") != self.key:
            return "manifest names another key"
        for rel, (size, digest) in files.items():
            path = self.entry / rel
            if not path.is_file():
                return f"{rel} is missing"
            if path.stat().st_size != size:
                return f"{rel} has {path.stat().st_size} bytes, expected {size}"
            if _sha256_file(path) != digest:
                return f"{rel} does not match its checksum"
        return None

    def copy_to(self, work_dir: Path) -> None:
        """Copies the entry's files (not the manifest) into a private directory torch may write to."""
        shutil.copytree(self.entry, work_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns(MANIFEST))

    def publish(self, work_dir: Path | None) -> bool:
        """Writes work_dir's files as the entry: into tmp/, manifest last, then one atomic rename. Returns
        False when another process published the key first (its entry is kept)."""
        tmp = self.root / "tmp" / f"{self.key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        tmp.parent.mkdir(parents=True, exist_ok=True)
        if work_dir is not None:
            shutil.copytree(work_dir, tmp, ignore=shutil.ignore_patterns("*.lock", "*.tmp*"))
        else:
            tmp.mkdir()
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            files[str(path.relative_to(tmp))] = [path.stat().st_size, _sha256_file(path)]
        (tmp / MANIFEST).write_text(json.dumps({"key": self.key, "files": files}))
        _fsync_tree(tmp)
        self.entry.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.rename(self.entry)
        except OSError:  # the entry exists: somebody else published it
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        self._record(created=True, size=sum(size for size, _ in files.values()))
        return True

    def touch(self) -> None:
        self._record(created=False, size=None)

    def _record(self, created: bool, size: int | None) -> None:
        """Updates catalog.json under its lock, replacing the file atomically."""
        catalog_path = self.root / "catalog.json"
        with file_lock(self.root / "locks" / "catalog.lock"):
            try:
                catalog = json.loads(catalog_path.read_text())
            except (OSError, ValueError):
                catalog = {"entries": {}}
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            entry = catalog["entries"].setdefault(self.key, {"configuration": self.configuration})
            if created or "created" not in entry:
                entry["created"] = now
            if size is not None:
                entry["size_bytes"] = size
            entry["last_used"] = now
            tmp = catalog_path.with_name(f"catalog.json.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(catalog, indent=2, sort_keys=True))
            tmp.replace(catalog_path)


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())


# ---- around warmup ---------------------------------------------------------------------------------


@dataclass
class WarmupResult:
    seconds: float
    cache: str  # "off" | "hit" | "miss" | "not needed"
    key: str | None
    num_compiled: int  # graphs inductor compiled (FX graph cache misses) in this process


def _inductor_misses() -> int:
    from torch._dynamo.utils import counters

    # frozen graphs (weights folded in as constants) bypass the FX graph cache: compiled all the same
    inductor = counters["inductor"]
    return int(inductor.get("fxgraph_cache_miss", 0) + inductor.get("fxgraph_cache_bypass", 0))


def open_cache(config: RuntimeConfig) -> GraphCache | None:
    """The configuration's cache, or None when no cache is used (off, or eager: nothing is compiled)."""
    if config.backend == "eager":
        return None
    if not config.cache_enabled:
        if config.require_precompiled:
            raise ConfigError(
                "SENDNN_INFERENCE_REQUIRE_PRECOMPILED_DECODERS=1 needs the graph cache: set "
                "TORCH_SENDNN_CACHE_ENABLE=1 and TORCH_SENDNN_CACHE_DIR"
            )
        return None
    configuration = cache_configuration(config)
    return GraphCache(config.cache_dir, cache_key(configuration), configuration)


def check_precompiled(config: RuntimeConfig) -> None:
    """Strict mode, before anything is loaded: fails with the missing key when the cache has no entry."""
    if not config.require_precompiled:
        return
    cache = open_cache(config)
    if cache is not None and not cache.is_valid():
        raise ConfigError(missing_entry_message(config, cache.key))


def missing_entry_message(config: RuntimeConfig, key: str) -> str:
    return (
        f"SENDNN_INFERENCE_REQUIRE_PRECOMPILED_DECODERS=1: the graph cache {config.cache_dir} has no entry "
        f"for key {key}; run `spyre-runtime compile` for this configuration first"
    )


def warmup_with_cache(executor, config: RuntimeConfig) -> WarmupResult:
    """Warms every shape, through the graph cache when it is enabled, in a load slot (a tensor-parallel
    group compiles in lockstep and takes one slot, rank 0's). Holding the key's lock, a second process
    compiling the same key waits for the first and then loads its entry: they compile once."""
    with loading(config):
        return _warmup(executor, config)


def _warmup(executor, config: RuntimeConfig) -> WarmupResult:
    cache = open_cache(config)
    before = _inductor_misses()
    if cache is None:
        seconds = executor.warmup()
        state = "off" if config.backend != "eager" else "not needed"
        return WarmupResult(seconds, state, None, _inductor_misses() - before)
    with cache.lock():
        hit = cache.is_valid()
        if not hit and config.require_precompiled:
            raise ConfigError(missing_entry_message(config, cache.key))
        work = _private_inductor_dir(executor) if config.backend == "inductor" else None
        if hit and work is not None:
            cache.copy_to(work)
        seconds = executor.warmup()
        compiled = _inductor_misses() - before
        if hit:
            cache.touch()
        elif cache.publish(work):
            log.info("Published graph cache entry %s", cache.key)
    log.info("Graph cache %s for key %s; %d graphs compiled", "hit" if hit else "miss", cache.key, compiled)
    return WarmupResult(seconds, "hit" if hit else "miss", cache.key, compiled)


def _private_inductor_dir(executor) -> Path:
    """A fresh inductor cache directory for this process (and its tensor-parallel ranks): only the
    published entry can warm it. Inductor reads TORCHINDUCTOR_CACHE_DIR when it first compiles, which is
    after this call. The directory goes when the process exits (a server on a host would otherwise leave
    1-3 MB in the temporary folder at every start)."""
    resolve_vector_isa()
    work = Path(tempfile.mkdtemp(prefix="spyre-inductor-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    executor.set_env({"TORCHINDUCTOR_CACHE_DIR": str(work)})
    return work


def resolve_vector_isa() -> None:
    """Has inductor choose this CPU's vector ISA now, in the process's usual cache directory. It decides once
    a process by compiling a probe per ISA into its cache directory and keeps the probes there (6 compiles,
    ~8 CPU-s in an empty directory, ~1 s where they are); done in a private directory, empty every time,
    every process would compile them again. The choice is the machine's, not the published entry's."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    valid_vec_isa_list()
