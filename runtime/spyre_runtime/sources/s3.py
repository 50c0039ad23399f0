"""`s3://BUCKET/PREFIX` through boto3: list the objects under the prefix, stream each with Range.

Credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN, else boto3's usual chain
(a profile, a web identity); none at all means unsigned requests (a public bucket). A custom endpoint
(MinIO, Ceph, moto) is addressed path-style. Checksums: a single-part object's ETag is its MD5; a multipart
one's is the MD5 of its parts' MD5s, computed with the part size read from `HEAD ?partNumber=1`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from spyre_runtime.sources.errors import FetchError
from spyre_runtime.sources.remote import Listing, RemoteFile
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
        etag = obj.get("ETag", "").strip('"')
        size = obj["Size"]
        if "-" in etag:
            with self._errors(key):
                head = self.client.head_object(Bucket=self.source.bucket, Key=key, PartNumber=1)
            return RemoteFile(name, size, "s3-multipart", etag, part_size=head["ContentLength"], etag=etag)
        if len(etag) == 32:
            return RemoteFile(name, size, "md5", etag, etag=etag)
        return RemoteFile(name, size, etag=etag or None)  # an ETag we cannot recompute: size only

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
        from botocore.exceptions import BotoCoreError, ClientError

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
        if isinstance(error, BotoCoreError | OSError):
            if "credential" in type(error).__name__.lower():
                raise FetchError(f"{uri}: bad credentials: {error}", transient=False) from error
            raise FetchError(f"{uri}: network error {where}: {error}", transient=True) from error
        return False
