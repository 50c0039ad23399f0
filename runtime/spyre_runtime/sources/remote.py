"""What a store lists and how its checksums are computed.

A store (s3.S3Store, hf.HfStore) answers two questions: `listing()` → Listing (the files, their sizes and
the checksums the store gives), and `open(file, offset)` → an iterator of byte chunks from `offset` on
(HTTP Range). Everything else (staging, resume, verification, publishing) is the store-independent
fetch.py."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class RemoteFile:
    name: str  # relative path inside the model folder, "/"-separated
    size: int
    checksum_kind: str | None = None  # "md5" | "s3-multipart" | "sha256" | "git-sha1" | None (size only)
    checksum: str | None = None  # hex digest (s3-multipart: the ETag, "<md5 of md5s>-<parts>")
    part_size: int = 0  # s3-multipart: the size of every part but the last
    etag: str | None = None  # the store's ETag: resumed ranges must come from the same object

    def as_manifest(self) -> dict:
        return {"name": self.name, "size": self.size, "checksum": self.checksum_kind, "digest": self.checksum}


@dataclass(frozen=True)
class Listing:
    revision: str | None  # hf: the revision asked for; s3: None
    commit: str | None  # hf: the commit the revision resolved to; s3: None
    files: tuple[RemoteFile, ...] = field(default_factory=tuple)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


class Store(Protocol):
    def listing(self) -> Listing: ...

    def open(self, file: RemoteFile, offset: int) -> Iterator[bytes]: ...


class Hasher:
    """Incremental checksum of one file, fed its bytes in order (a resumed file: its prefix first)."""

    def __init__(self, file: RemoteFile) -> None:
        self.kind = file.checksum_kind
        self.part_size = file.part_size
        self._parts: list[bytes] = []
        self._in_part = 0
        if self.kind in ("md5", "s3-multipart"):
            self._hash = hashlib.md5(usedforsecurity=False)
        elif self.kind == "sha256":
            self._hash = hashlib.sha256()
        elif self.kind == "git-sha1":
            self._hash = hashlib.sha1(f"blob {file.size}\0".encode(), usedforsecurity=False)
        else:
            self._hash = None

    def update(self, data: bytes) -> None:
        if self._hash is None:
            return
        if self.kind != "s3-multipart":
            self._hash.update(data)
            return
        view = memoryview(data)
        while view:
            take = min(len(view), self.part_size - self._in_part)
            self._hash.update(view[:take])
            self._in_part += take
            view = view[take:]
            if self._in_part == self.part_size:
                self._close_part()

    def _close_part(self) -> None:
        self._parts.append(self._hash.digest())
        self._hash = hashlib.md5(usedforsecurity=False)
        self._in_part = 0

    def hexdigest(self) -> str | None:
        if self._hash is None:
            return None
        if self.kind != "s3-multipart":
            return self._hash.hexdigest()
        if self._in_part:
            self._close_part()
        combined = hashlib.md5(b"".join(self._parts), usedforsecurity=False).hexdigest()
        return f"{combined}-{len(self._parts)}"
