"""`spyre-runtime fetch-model`: one run from a source URI to a published model folder.

parse → already published? (print `cached:` and stop, no request) → list → stage (keep what a former run
verified) → enough space? → fetch each file (resume by Range, hash while writing, retry transient errors
with back-off) → manifest → rename. Exit 0 published or cached, 1 transient failure (the Job retries),
2 permanent failure; on failure the last stderr line says what failed and DIR does not exist."""

from __future__ import annotations

import errno
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from spyre_runtime.sources.errors import FetchError
from spyre_runtime.sources.progress import PodAnnotator, Progress
from spyre_runtime.sources.remote import Hasher, Listing, RemoteFile, Store
from spyre_runtime.sources.staging import Staging
from spyre_runtime.sources.uri import HfSource, parse_source

log = logging.getLogger("spyre_runtime.sources")

RETRIES_ENV = "SPYRE_FETCH_RETRIES"
BACKOFF_SECONDS = 0.5


def human(num_bytes: int) -> str:
    value = float(num_bytes)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{num_bytes} bytes" if unit == "bytes" else f"{value:.1f} {unit} ({num_bytes} bytes)"
        value /= 1024
    raise AssertionError("unreachable")


def volume_of(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    while not os.path.ismount(path):
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_space(path: Path, need: int, free: Callable[[Path], int] = free_bytes) -> None:
    have = free(path)
    if need > have:
        raise FetchError(
            f"not enough space on {volume_of(path)}: need {human(need)}, have {human(have)}", transient=False
        )


def open_store(uri: str, endpoint: str | None, env: Mapping[str, str]) -> Store:
    source = parse_source(uri)
    if isinstance(source, HfSource):
        from spyre_runtime.sources.hf import HfStore

        return HfStore(source, endpoint, env)
    from spyre_runtime.sources.s3 import S3Store

    return S3Store(source, endpoint, env)


def tries_from_env(env: Mapping[str, str]) -> int:
    text = env.get(RETRIES_ENV, "3")
    try:
        tries = int(text)
    except ValueError:
        tries = 0
    if tries < 1:
        raise FetchError(f"{RETRIES_ENV}={text!r} must be a positive number of tries", transient=False)
    return tries


def with_retries(what: str, tries: int, action: Callable[[], object]):
    """Runs `action`; a transient FetchError is retried after 0.5 s, 1 s, 2 s, ... up to `tries` runs, an
    error that sets `retries` (an unreachable endpoint, a checksum mismatch) at most that often."""
    for attempt in range(tries):
        try:
            return action()
        except FetchError as e:
            allowed = e.retries if e.retries is not None else (tries - 1 if e.transient else 0)
            runs = min(allowed + 1, tries)
            if attempt >= runs - 1:
                raise
            delay = BACKOFF_SECONDS * 2**attempt
            log.warning("%s (try %d of %d; again in %.1f s)", e, attempt + 1, runs, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def _write_all(out, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[out.write(view) :]


def fetch_file(store: Store, staging: Staging, file: RemoteFile, progress: Progress, uri: str) -> None:
    """Brings one file in DIR.partial to its full size (resuming from what is on disk) and verifies it."""
    path = staging.path(file)
    path.parent.mkdir(parents=True, exist_ok=True)
    if staging.bytes_on_disk(file) > file.size:
        progress.rewind(staging.bytes_on_disk(file))
        path.unlink()
    hasher = Hasher(file)
    with open(path, "ab+", buffering=0) as out:  # unbuffered: ENOSPC surfaces at write(), not at close()
        out.seek(0)  # the prefix a former run wrote feeds the hash first; appends still go to the end
        while chunk := out.read(1 << 20):
            hasher.update(chunk)
        start, cause = out.tell(), None
        try:
            if start < file.size:
                for chunk in store.open(file, start):
                    _write_all(out, chunk)
                    hasher.update(chunk)
                    progress.advance(len(chunk))
            os.fsync(out.fileno())
        except FetchError as e:
            if not e.transient:
                raise
            cause = e
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            have = free_bytes(path.parent)
            raise FetchError(
                f"not enough space on {volume_of(path)}: need {human(file.size - start)}, have {human(have)} "
                f"(ENOSPC writing {file.name})",
                transient=False,
            ) from e
        got = out.seek(0, os.SEEK_END)
    if got != file.size:
        detail = f"truncated transfer: {cause}" if cause else "truncated transfer"
        if got > file.size:
            progress.rewind(got)
            path.unlink()
            detail = "more bytes than listed"
        raise FetchError(
            f"{uri}: file {file.name}: expected {file.size} bytes, got {got} ({detail})", transient=True
        )
    digest = hasher.hexdigest()
    if digest is not None and digest != file.checksum:
        progress.rewind(got)
        path.unlink()
        raise FetchError(
            f"{uri}: file {file.name}: checksum mismatch ({file.checksum_kind} expected {file.checksum}, "
            f"got {digest})",
            transient=False,
            retries=1,
        )
    staging.mark_verified(file)


def manifest_of(uri: str, listing: Listing) -> dict:
    return {
        "format": 1,
        "source": uri,
        "revision": listing.revision,
        "commit": listing.commit,
        "files": [f.as_manifest() for f in listing.files],
        "num_files": len(listing.files),
        "total_bytes": listing.total_bytes,
        "fetched_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def fetch_model(
    uri: str,
    into: str | Path,
    endpoint: str | None = None,
    *,
    env: Mapping[str, str] = os.environ,
    free: Callable[[Path], int] = free_bytes,
) -> dict:
    """Publishes `uri` at `into` and returns its manifest; raises FetchError. `free` reads the free bytes
    of a folder's volume (statvfs; a test may pass another reading)."""
    parse_source(uri)
    tries = tries_from_env(env)
    staging = Staging(into, uri)
    if (manifest := staging.cached()) is not None:
        if (pod := PodAnnotator.from_env(env)) is not None:
            pod.patch(manifest["total_bytes"], manifest["total_bytes"])
        print(
            f"cached: {staging.into} ({manifest['total_bytes']} bytes, {manifest['num_files']} files)",
            flush=True,
        )
        return manifest
    started = time.monotonic()
    store = open_store(uri, endpoint, env)
    listing = with_retries(uri, tries, store.listing)
    try:
        staging.prepare(listing)
        todo = [f for f in listing.files if not staging.is_verified(f)]
        on_disk = sum(min(staging.bytes_on_disk(f), f.size) for f in listing.files)
        check_space(staging.partial, sum(f.size - min(staging.bytes_on_disk(f), f.size) for f in todo), free)
        progress = Progress(listing.total_bytes, on_disk, pod=PodAnnotator.from_env(env))
        for file in todo:
            with_retries(uri, tries, lambda file=file: fetch_file(store, staging, file, progress, uri))
        manifest = manifest_of(uri, listing)
        staging.publish(listing, manifest)
    finally:
        staging.unlock()
    progress.report()
    progress.emit(
        {
            "event": "done",
            "dir": str(staging.into),
            "source": uri,
            "commit": listing.commit,
            "bytes": listing.total_bytes,
            "files": len(listing.files),
            "downloaded": progress.downloaded,
            "seconds": round(time.monotonic() - started, 3),
        }
    )
    return manifest


def main(uri: str, into: str, endpoint: str | None = None) -> int:
    """The CLI's entry: exit code, and on failure one readable last line on stderr."""
    for noisy in ("httpx2", "httpx", "botocore", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)  # one line per request is the servers' job
    try:
        fetch_model(uri, into, endpoint)
    except FetchError as e:
        sys.stdout.flush()
        print(str(e), file=sys.stderr, flush=True)
        return e.exit_code
    return 0
