"""`s3://BUCKET/PREFIX` through boto3: list the objects under the prefix, stream each with Range.

Credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN, else boto3's usual chain
(a profile, a web identity); none at all means unsigned requests (a public bucket). A custom endpoint
(MinIO, Ceph, moto) is addressed path-style.

Checksums, read with one `HEAD` per object (`ChecksumMode=ENABLED`); the size is always checked, and of what
the object has, the first that can be recomputed is verified: its SHA-256 or SHA-1 checksum, else its
ETag when that is known to be an MD5 (neither SSE-KMS nor SSE-C: their ETags are not; a single-part ETag
is the data's MD5, a multipart one "<MD5 of the parts' MD5s>-<parts>"), else its CRC32C (with a native
CRC32C installed) or CRC32 checksum. A multipart object's checksum is computed over its parts as uploaded,
their sizes read with `HEAD ?partNumber=N` for each part (parts may differ in size, not only the last)."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator, Mapping

from spyre_runtime.sources.errors import FetchError, unreachable
from spyre_runtime.sources.remote import Listing, RemoteFile, crc32c_function
from spyre_runtime.sources.uri import S3Source

_CHUNK = 256 << 10  # what a cut transfer can lose of its last read
_ACCESS = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "AllAccessDisabled",
    "403",
}
_MISSING = {"NoSuchBucket", "NoSuchKey", "404", "NotFound"}
_CHECKSUM_FIELDS = (
    ("ChecksumSHA256", "sha256"),
    ("ChecksumSHA1", "sha1"),
    ("ETag", "md5"),
    ("ChecksumCRC32C", "crc32c"),
    ("ChecksumCRC32", "crc32"),
)


class S3Store:
    def __init__(self, source: S3Source, endpoint: str | None, env: Mapping[str, str]) -> None:
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config

        self.source = source
        self.endpoint = endpoint or env.get("AWS_ENDPOINT_URL") or None
        keys = {
            "aws_access_key_id": env.get("AWS_ACCESS_KEY_ID"),
            "aws_secret_access_key": env.get("AWS_SECRET_ACCESS_KEY"),
            "aws_session_token": env.get("AWS_SESSION_TOKEN"),
        }
        # keys from `env` when it has them (the CLI passes os.environ), else boto3's chain (profiles, IRSA)
        session = boto3.Session(**keys) if keys["aws_access_key_id"] else boto3.Session()
        signed = session.get_credentials() is not None
        config = Config(
            signature_version=None if signed else UNSIGNED,
            retries={"max_attempts": 2, "mode": "standard"},
            connect_timeout=10,
            read_timeout=60,
            s3={"addressing_style": "path" if self.endpoint else "auto"},
        )
        region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
        self.client = session.client("s3", endpoint_url=self.endpoint, region_name=region, config=config)

    @property
    def where(self) -> str:
        return f"at endpoint {self.endpoint}" if self.endpoint else "on AWS S3"

    def listing(self) -> Listing:
        src = self.source
        prefix = f"{src.prefix}/" if src.prefix else ""
        objects = []
        with self._errors():
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=src.bucket, Prefix=prefix
            ):
                objects += [o for o in page.get("Contents", []) if not o["Key"].endswith("/")]
        if not objects:
            raise FetchError(f"{src.uri}: no objects under this prefix {self.where}", transient=False)
        files = tuple(self._remote_file(o["Key"], o["Key"][len(prefix) :], o) for o in objects)
        return Listing(revision=None, commit=None, files=files)

    def _remote_file(self, key: str, name: str, obj: dict) -> RemoteFile:
        size, etag = obj["Size"], obj.get("ETag", "").strip('"')
        with self._errors(key):
            head = self.client.head_object(Bucket=self.source.bucket, Key=key, ChecksumMode="ENABLED")
        for kind, digest, parts in _checksums(head, etag):
            part_sizes = self._part_sizes(key, parts, size) if parts else ()
            if part_sizes is not None:
                return RemoteFile(name, size, kind, digest, part_sizes=part_sizes, etag=etag or None)
        return RemoteFile(name, size, etag=etag or None)  # nothing we can recompute: size only

    def _part_sizes(self, key: str, parts: int, size: int) -> tuple[int, ...] | None:
        """The size of each part of a multipart object, or None when the store's answers do not add up
        to the object (a store that ignores partNumber): then that checksum cannot be recomputed."""
        sizes = []
        with self._errors(key):
            for number in range(1, parts + 1):
                head = self.client.head_object(Bucket=self.source.bucket, Key=key, PartNumber=number)
                sizes.append(head["ContentLength"])
        return tuple(sizes) if sum(sizes) == size else None

    def open(self, file: RemoteFile, offset: int) -> Iterator[bytes]:
        key = f"{self.source.prefix}/{file.name}" if self.source.prefix else file.name
        extra = {"Range": f"bytes={offset}-"} if offset else {}
        if file.etag:
            extra["IfMatch"] = f'"{file.etag}"'  # a changed object is not resumed into the old one
        with self._errors(key):
            body = self.client.get_object(Bucket=self.source.bucket, Key=key, **extra)["Body"]
            try:
                yield from body.iter_chunks(_CHUNK)
            finally:
                body.close()

    def _errors(self, key: str | None = None):
        return _S3Errors(self, key)


def _etag_is_md5(head: dict) -> bool:
    """S3's ETag is an MD5 (of the data, or of the parts' MD5s) unless the object is encrypted with SSE-KMS
    or a customer key (SSE-C)."""
    return not head.get("SSECustomerAlgorithm") and head.get("ServerSideEncryption") in (None, "AES256")


def _checksums(head: dict, etag: str) -> Iterator[tuple[str, str, int]]:
    """(kind, hex digest, number of parts or 0) for each checksum the object has that can be recomputed,
    the strongest first: SHA-256, SHA-1, an MD5 ETag, CRC32C, CRC32."""
    multipart = re.fullmatch(r"([0-9a-f]{32})-(\d+)", etag)
    etag_parts = int(multipart[2]) if multipart else 0
    for field, algorithm in _CHECKSUM_FIELDS:
        if field == "ETag":
            if _etag_is_md5(head) and multipart:
                yield "s3-multipart", etag, etag_parts
            elif _etag_is_md5(head) and re.fullmatch(r"[0-9a-f]{32}", etag):
                yield "md5", etag, 0
            continue
        value = head.get(field)
        if not value or (algorithm == "crc32c" and crc32c_function() is None):
            continue
        encoded, _, suffix = value.partition("-")
        try:
            digest = base64.b64decode(encoded, validate=True).hex()
        except ValueError:
            continue
        kind = head.get("ChecksumType") or _checksum_type(algorithm, suffix, etag_parts)
        if kind == "FULL_OBJECT":
            yield algorithm, digest, 0
        elif kind == "COMPOSITE" and (parts := int(suffix) if suffix.isdigit() else etag_parts):
            yield f"s3-composite-{algorithm}", f"{digest}-{parts}", parts


def _checksum_type(algorithm: str, suffix: str, parts: int) -> str | None:
    """The checksum's type when the store does not say (older stores, moto): "-<parts>" marks a composite
    one; a SHA checksum of a multipart object can only be composite; a CRC of one could be either: None."""
    if suffix or (parts and algorithm.startswith("sha")):
        return "COMPOSITE"
    return None if parts else "FULL_OBJECT"


class _S3Errors:
    """Maps botocore's exceptions to FetchError: what failed, where, and whether a retry can help."""

    def __init__(self, store: S3Store, key: str | None) -> None:
        self.store = store
        self.key = key

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, tb) -> bool:
        if error is None or isinstance(error, FetchError | GeneratorExit):
            return False
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            ConnectTimeoutError,
            EndpointConnectionError,
        )

        uri, where = self.store.source.uri, self.store.where
        if isinstance(error, ClientError):
            code = str(error.response.get("Error", {}).get("Code", ""))
            status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code in _ACCESS or status == 403:
                raise FetchError(f"{uri}: access denied ({code}) {where}", transient=False) from error
            if code in _MISSING or status == 404:
                what = f"bucket {self.store.source.bucket!r}" if "Bucket" in code or not self.key else None
                what = what or f"object {self.key!r}"
                raise FetchError(f"{uri}: {what} not found ({code}) {where}", transient=False) from error
            if code == "PreconditionFailed" or status == 412:
                raise FetchError(f"{uri}: object {self.key!r} changed during the fetch", transient=True)
            raise FetchError(f"{uri}: S3 error {code} (HTTP {status}) {where}", transient=True) from error
        if isinstance(error, EndpointConnectionError | ConnectTimeoutError):
            raise unreachable(uri, self.store.endpoint or "AWS S3", error) from error
        if isinstance(error, BotoCoreError | OSError):
            if "credential" in type(error).__name__.lower():
                raise FetchError(f"{uri}: bad credentials: {error}", transient=False) from error
            raise FetchError(f"{uri}: network error {where}: {error}", transient=True) from error
        return False
