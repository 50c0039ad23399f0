"""The graph cache's key (graph_cache.py): a digest of everything that changes the compiled graphs, the
model's files included. Hashing the weights is remembered, in this process and across processes (in the
cache's digests/), under each file's identity, so a warm start does not hash hundreds of MB again."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import uuid
from importlib import metadata
from pathlib import Path

from spyre_runtime.config import RuntimeConfig
from spyre_runtime.executor.compiler import MAX_BLOCK_CALLS


def _sha256_file(path: Path) -> str:
    """Memoized per (path, inode, size, modification and change times) within this process: strict mode's
    early check and the warmup after it hash the weights (hundreds of MB) and the entry once, not twice."""
    st = path.stat()
    return _sha256_of(str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@functools.lru_cache(maxsize=256)
def _sha256_of(path: str, inode: int, size: int, mtime_ns: int, ctime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def model_file_digest(path: Path, memo_dir: Path | None) -> str:
    """sha256 of a model file, remembered across processes in `memo_dir` (the cache's digests/) under the
    file's identity (inode, size, modification and change times, path): hashing SmolLM2's 538 MB of weights
    took 1.9 s of every start. Any write, rename or copy over the file sets its change time (ctime), which,
    unlike the modification time, no tool can set back (`cp -p`, `rsync -a` and `touch` cannot), so a changed
    file has a new identity and is hashed again: pooling models compile their weights into the graph, and a
    stale digest would load another model's graphs. No device number: it differs between mounts of one
    volume, and pods would then miss the memo. Entry files are always hashed (their checksums are what
    catches a corrupt entry)."""
    if memo_dir is None:
        return _sha256_file(path)
    st = path.stat()
    identity = f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{path.resolve()}"
    memo = memo_dir / hashlib.sha256(identity.encode()).hexdigest()[:32]
    with contextlib.suppress(OSError, UnicodeDecodeError):
        known = memo.read_text().strip()
        if len(known) == 64 and all(c in "0123456789abcdef" for c in known):
            return known
    digest = _sha256_file(path)
    tmp = memo.with_name(f"{memo.name}.{os.getpid()}.{uuid.uuid4().hex[:6]}.tmp")
    try:  # one rename: a reader sees the whole digest or none
        memo_dir.mkdir(parents=True, exist_ok=True)
        tmp.write_text(digest + "\n")
        tmp.replace(memo)
    except OSError:  # a read-only or full cache volume: hashed again next time
        with contextlib.suppress(OSError):
            tmp.unlink()
    return digest


# The layout of the compiled graphs (attention op, mixed steps, packed linear layers): a change of it makes
# earlier entries misses, whatever the package's version says. 2: mixed steps, paged decode, packed weights;
# 3: mixed steps prefill pieces of several prompts (paged prefill op); 4: regional compilation (a graph per
# group of decoder blocks, `compiler.MAX_BLOCK_CALLS`), ops registered at the dispatcher's CPU key (ops.py);
# 5: a SwiGLU feed-forward's gate, up and SiLU in one op (linear.packed_glu); 6: bfloat16 layers go through
# the packed op where oneDNN cannot pack them (linear.can_route).
GRAPH_FORMAT = 6


def cache_configuration(config: RuntimeConfig) -> dict:
    """Everything that changes the compiled graphs, as plain JSON."""
    import torch

    model_dir = config.model_dir
    memo = config.cache_dir / "digests" if config.cache_enabled and config.cache_dir else None
    weights = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))
    shapes: dict
    if config.use_cb:
        shapes = {
            "mode": "continuous",
            "max_model_len": config.max_model_len,
            "max_num_seqs": config.max_num_seqs,
            "chunk_buckets": list(config.chunk_buckets),
            "batch_buckets": list(config.batch_buckets),
            "kv_buckets": list(config.kv_buckets),
            "num_kv_blocks": config.cb_num_blocks,
            "mixed_steps": config.cp_interleave_steps,  # chunk graphs with or without the decode rows
            "prefill_pieces": config.prefill_pieces,
            "dynamic_chunks": config.dynamic_chunks,  # one mixed graph, dynamic in its token count
            "dynamic_decode": config.dynamic_decode,  # the decode buckets that share one graph (inductor)
        }
    else:
        shapes = {
            "mode": "static",
            "shapes": [[s.prompt_len, s.new_tokens, s.batch_size] for s in config.shapes],
        }
    return {
        "model": {
            "config_sha256": _sha256_file(model_dir / "config.json"),
            "weights_sha256": hashlib.sha256(
                "".join(f"{p.name}:{model_file_digest(p, memo)};" for p in weights).encode()
            ).hexdigest(),
        },
        "backend": config.backend,
        "dtype": config.dtype,
        # the KV cache's dtype changes every graph that reads it; left out at auto, so that the keys of
        # entries compiled before the setting existed stay the same
        **({"kv_cache_dtype": config.kv_cache_dtype} if config.kv_cache_dtype != "auto" else {}),
        "graph_format": GRAPH_FORMAT,
        "max_block_calls": MAX_BLOCK_CALLS,  # the blocks one compiled graph holds (inductor)
        "shapes": shapes,
        "tensor_parallel_size": config.tensor_parallel_size,
        "versions": {
            "torch": torch.__version__,
            "ibm-fms": _version("ibm-fms"),
            "spyre-serve": _version("spyre-serve"),
        },
    }


def cache_key(configuration: dict) -> str:
    text = json.dumps(configuration, sort_keys=True)
    return f"{configuration['backend']}-{hashlib.sha256(text.encode()).hexdigest()[:24]}"
