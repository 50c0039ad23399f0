"""The sources this loader downloads, `hf://ORG/NAME[@REVISION]` and `s3://BUCKET/PREFIX`, parsed by the one
grammar the operator and the CRD share (spyre_contract.source_uri); anything else is a permanent error."""

from __future__ import annotations

from dataclasses import dataclass

from spyre_contract.source_uri import SourceError, parse_source_uri

from spyre_runtime.sources.errors import FetchError


@dataclass(frozen=True)
class HfSource:
    uri: str
    repo_id: str
    revision: str  # "main" (the Hub's default) when the URI names none


@dataclass(frozen=True)
class S3Source:
    uri: str
    bucket: str
    prefix: str  # the model's folder, a key prefix without a trailing slash


def parse_source(uri: str) -> HfSource | S3Source:
    try:
        source = parse_source_uri(uri)
    except SourceError as e:
        raise FetchError(
            f"{uri!r} is not a model source this loader fetches: {e} (expected hf://ORG/NAME[@REVISION] "
            "or s3://BUCKET/PREFIX)",
            transient=False,
        ) from None
    if source.scheme == "hf":
        return HfSource(uri, source.repo, source.revision)
    if source.scheme == "s3":
        return S3Source(uri, source.bucket, source.prefix)
    raise FetchError(
        f"{uri!r} is not a model source this loader fetches: expected hf://ORG/NAME[@REVISION] "
        "or s3://BUCKET/PREFIX",
        transient=False,
    )
