"""DIR.partial: where a fetch stages, resumes and verifies before one rename publishes DIR.

Invariants: DIR appears only by `os.rename(DIR.partial, DIR)`, after every file was verified and the
manifest `.spyre-model.json` written, so a reader sees either no DIR or a whole one. DIR.partial is a
sibling on the same volume (a rename never copies). `.spyre-fetch-state.json` in DIR.partial lists the
files already verified for this source and commit: a rerun skips them and resumes the others from their
size on disk."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from pathlib import Path, PurePosixPath

from spyre_runtime.sources.errors import FetchError
from spyre_runtime.sources.remote import Listing, RemoteFile

MANIFEST = ".spyre-model.json"
STATE = ".spyre-fetch-state.json"


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class Staging:
    def __init__(self, into: str | Path, source: str) -> None:
        self.into = Path(into).absolute()
        self.partial = self.into.with_name(self.into.name + ".partial")
        self.source = source
        self._verified: dict[str, dict] = {}
        self._key: dict = {}
        self._lock_fd: int | None = None

    # ---- the published folder ----------------------------------------------------------------

    def cached(self) -> dict | None:
        """The manifest of an already published DIR for this source (no network, no hashing), else None.
        A DIR that is not ours, or holds another source, is a permanent error: never overwritten."""
        if not self.into.exists():
            return None
        manifest = _read_json(self.into / MANIFEST)
        if manifest is None:
            raise FetchError(
                f"{self.into} exists and has no valid {MANIFEST}: not a folder this loader published "
                "(remove it to fetch again)",
                transient=False,
            )
        if manifest.get("source") != self.source:
            raise FetchError(
                f"{self.into} holds {manifest.get('source')!r}, not {self.source!r} (remove it or pick "
                "another folder)",
                transient=False,
            )
        for entry in manifest.get("files", []):
            path = self.into / entry["name"]
            if not path.is_file() or path.stat().st_size != entry["size"]:
                raise FetchError(
                    f"{self.into}: published file {entry['name']} is missing or not {entry['size']} bytes "
                    "(the cache was changed after publishing; remove the folder to fetch again)",
                    transient=False,
                )
        return manifest

    # ---- staging ------------------------------------------------------------------------------

    def prepare(self, listing: Listing) -> None:
        """Creates DIR.partial, keeps what a former run of the same source and commit verified or
        left half-written, and removes everything else."""
        self.partial.mkdir(parents=True, exist_ok=True)
        self._lock()
        self._key = {"source": self.source, "commit": listing.commit}
        state = _read_json(self.partial / STATE) or {}
        same = {k: state.get(k) for k in self._key} == self._key
        self._verified = dict(state.get("verified", {})) if same else {}
        names = {f.name for f in listing.files}
        for file in listing.files:
            self.path(file)  # refuses names that leave the folder before anything is written
        for path in sorted(self.partial.rglob("*"), reverse=True):
            rel = path.relative_to(self.partial).as_posix()
            if path.is_file() and rel not in names and rel != STATE:
                path.unlink()
            elif path.is_dir() and not any(path.iterdir()):
                path.rmdir()
        if not same:
            for file in listing.files:
                with contextlib.suppress(FileNotFoundError):
                    self.path(file).unlink()

    def _lock(self) -> None:
        """One loader per DIR.partial: a second one (an overlapping Job pod) fails transiently and,
        retried, finds DIR published. The lock lives as long as the process."""
        fd = os.open(self.partial, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FetchError(
                f"{self.source}: another loader is fetching into {self.partial}", transient=True
            ) from None
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def path(self, file: RemoteFile) -> Path:
        rel = PurePosixPath(file.name)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts or file.name in (MANIFEST, STATE):
            raise FetchError(f"{self.source}: refusing file name {file.name!r}", transient=False)
        return self.partial.joinpath(*rel.parts)

    def bytes_on_disk(self, file: RemoteFile) -> int:
        try:
            return self.path(file).stat().st_size
        except FileNotFoundError:
            return 0

    def is_verified(self, file: RemoteFile) -> bool:
        entry = self._verified.get(file.name)
        return entry == file.as_manifest() and self.bytes_on_disk(file) == file.size

    def mark_verified(self, file: RemoteFile) -> None:
        self._verified[file.name] = file.as_manifest()
        _write_json(self.partial / STATE, {**self._key, "verified": self._verified})

    def publish(self, listing: Listing, manifest: dict) -> None:
        """Writes the manifest into DIR.partial and renames it to DIR (one atomic step)."""
        missing = [f.name for f in listing.files if not self.is_verified(f)]
        if missing:
            raise RuntimeError(f"publishing with unverified files: {missing}")
        _write_json(self.partial / MANIFEST, manifest)
        (self.partial / STATE).unlink(missing_ok=True)
        if self.into.exists():  # another loader published first: ours is not needed
            shutil.rmtree(self.partial)
            return
        os.rename(self.partial, self.into)
        fd = os.open(self.into.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
