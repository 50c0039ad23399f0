"""What a store lists and how its checksums are computed.

A store (s3.S3Store, hf.HfStore) answers two questions: `listing()` → Listing (the files, their sizes and
the checksums the store gives), and `open(file, offset)` → an iterator of byte chunks from `offset` on
(HTTP Range). Everything else (staging, resume, verification, publishing) is the store-independent
fetch.py."""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class RemoteFile:
    name: str  # relative path inside the model folder, "/"-separated
    size: int
    checksum_kind: str | None = None  # a Hasher kind ("md5", "sha256", "s3-multipart"...) | None (size only)
    checksum: str | None = None  # hex digest (multipart kinds: "<hex of the parts' digests>-<parts>")
    part_sizes: tuple[int, ...] = ()  # multipart kinds: the size of each part, as uploaded
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


def crc32c_function() -> Callable[[bytes, int], int] | None:
    """CRC32C (Castagnoli) when a native implementation is installed (awscrt, botocore's optional one, or
    google-crc32c), else None: a pure-Python CRC32C would take minutes per GiB."""
    try:
        from awscrt.checksums import crc32c

        return crc32c
    except ImportError:
        pass
    try:
        import google_crc32c

        return lambda data, value: google_crc32c.extend(value, bytes(data))
    except ImportError:
        return None


class _Crc:
    """A CRC with hashlib's face: the digest is the 4-byte big-endian value S3 gives (in base64)."""

    def __init__(self, function: Callable[[bytes, int], int]) -> None:
        self._function = function
        self._value = 0

    def update(self, data: bytes) -> None:
        self._value = self._function(data, self._value)

    def digest(self) -> bytes:
        return self._value.to_bytes(4, "big")

    def hexdigest(self) -> str:
        return self.digest().hex()


def new_hash(algorithm: str):
    if algorithm == "md5":
        return hashlib.md5(usedforsecurity=False)
    if algorithm in ("sha1", "sha256"):
        return hashlib.new(algorithm)
    if algorithm == "crc32":
        return _Crc(zlib.crc32)
    if algorithm == "crc32c" and (function := crc32c_function()) is not None:
        return _Crc(function)
    raise ValueError(f"no checksum algorithm {algorithm!r}")


class Hasher:
    """Incremental checksum of one file, fed its bytes in order (a resumed file: its prefix first).

    Kinds: a whole-file digest ("md5", "sha256", "sha1", "crc32", "crc32c", "git-sha1"), or one over the
    digests of the parts of a multipart upload, cut at `part_sizes` ("s3-multipart": the MD5 of the parts'
    MD5s; "s3-composite-<algorithm>": S3's composite checksum), written "<hex>-<number of parts>"."""

    def __init__(self, file: RemoteFile) -> None:
        kind = file.checksum_kind
        self.kind = kind
        self.composite = kind == "s3-multipart" or (kind or "").startswith("s3-composite-")
        self.algorithm = "md5" if kind == "s3-multipart" else (kind or "").removeprefix("s3-composite-")
        self.part_sizes = list(file.part_sizes)
        self._parts: list[bytes] = []
        self._in_part = 0
        if kind is None:
            self._hash = None
        elif kind == "git-sha1":
            self._hash = hashlib.sha1(f"blob {file.size}\0".encode(), usedforsecurity=False)
        else:
            self._hash = new_hash(self.algorithm)

    def update(self, data: bytes) -> None:
        if self._hash is None:
            return
        if not self.composite:
            self._hash.update(data)
            return
        view = memoryview(data)
        while view:
            part = len(self._parts)
            size = self.part_sizes[part] if part < len(self.part_sizes) else len(view) + self._in_part
            take = min(len(view), size - self._in_part)
            self._hash.update(view[:take])
            self._in_part += take
            view = view[take:]
            if self._in_part == size:
                self._close_part()

    def _close_part(self) -> None:
        self._parts.append(self._hash.digest())
        self._hash = new_hash(self.algorithm)
        self._in_part = 0

    def hexdigest(self) -> str | None:
        if self._hash is None:
            return None
        if not self.composite:
            return self._hash.hexdigest()
        if self._in_part:
            self._close_part()
        combined = new_hash(self.algorithm)
        combined.update(b"".join(self._parts))
        return f"{combined.hexdigest()}-{len(self._parts)}"
