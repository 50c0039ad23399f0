"""`hf://ORG/NAME[@REVISION]` and `s3://BUCKET/PREFIX`, parsed; anything else is a permanent error."""

from __future__ import annotations

import re
from dataclasses import dataclass

from spyre_runtime.sources.errors import FetchError

_HF = re.compile(r"^hf://(?P<org>[\w.-]+)/(?P<name>[\w.-]+)(?:@(?P<revision>[^\s@]+))?/?$")
_S3 = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(?P<prefix>[^\s]*))?$")


@dataclass(frozen=True)
class HfSource:
    uri: str
    repo_id: str
    revision: str  # "main" when the URI names none


@dataclass(frozen=True)
class S3Source:
    uri: str
    bucket: str
    prefix: str  # "" (the whole bucket) or a key prefix without a trailing slash


def parse_source(uri: str) -> HfSource | S3Source:
    if match := _HF.match(uri):
        return HfSource(uri, f"{match['org']}/{match['name']}", match["revision"] or "main")
    if match := _S3.match(uri):
        return S3Source(uri, match["bucket"], (match["prefix"] or "").strip("/"))
    raise FetchError(
        f"{uri!r} is not a model source this loader fetches: expected hf://ORG/NAME[@REVISION] "
        "or s3://BUCKET/PREFIX",
        transient=False,
    )
