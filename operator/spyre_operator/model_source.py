"""Where a SpyreModel's weights come from (spec.model.source), as the URIs it takes, and how each one reaches
the pods: a claim (`pvc://CLAIM/PATH`), a folder on the node (`file:///PATH`, admin-enabled), a model image
(`oci://REGISTRY/REPO[:TAG|@DIGEST]`, mounted read-only), or a download into the shared model cache by the
loader Job (`hf://ORG/NAME[@REVISION]`, `s3://BUCKET/PREFIX`). `parse_source` is the one grammar; the CRD's
pattern and CEL rule state the same."""

from __future__ import annotations

import re
from dataclasses import dataclass

from spyre_operator.image_reference import REFERENCE, image_reference_error

SCHEMES = ("pvc", "file", "oci", "hf", "s3")
DOWNLOADED = ("hf", "s3")  # filled into the model cache by the loader Job
USAGE = "pvc://CLAIM/PATH, file:///PATH, oci://REGISTRY/REPO[:TAG|@DIGEST], hf://ORG/NAME[@REVISION] or s3://BUCKET/PREFIX"

_PVC = re.compile(r"^pvc://(?P<claim>[a-z0-9]([-a-z0-9.]*[a-z0-9])?)/(?P<path>.*)$")
_FILE = re.compile(r"^file://(?P<path>/.+)$")
# the Hub's repository ids: letters, digits, '-', '_', '.'; a revision is a branch, tag or commit
_HF_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_HF = re.compile(
    rf"^hf://(?P<repo>{_HF_PART}/{_HF_PART})(?:@(?P<revision>[A-Za-z0-9][A-Za-z0-9._/-]{{0,127}}))?$"
)
# S3 bucket names: 3-63 lower-case letters, digits, '.' and '-'; the prefix is the model's folder
_S3 = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])/(?P<prefix>[^\s]*[^\s/][^\s]*)$")


class SourceError(ValueError):
    """spec.model.source does not parse; the message says what is wrong with it."""


@dataclass(frozen=True)
class Source:
    scheme: str
    uri: str
    claim: str = ""  # pvc: the claim
    path: str = ""  # pvc: the folder in the claim; file: the folder on the node
    image: str = ""  # oci: the model image's reference
    repo: str = ""  # hf: ORG/NAME
    revision: str = ""  # hf: a branch, tag or commit ("" the default branch)
    bucket: str = ""  # s3
    prefix: str = ""  # s3: the model's folder in the bucket

    @property
    def is_downloaded(self) -> bool:
        """hf:// and s3://: the loader Job fills the model cache, which the pods mount."""
        return self.scheme in DOWNLOADED


def parse_source(uri: str) -> Source:
    """The source a URI names; SourceError saying what is wrong otherwise."""
    if not isinstance(uri, str):
        raise SourceError(f"must be one of {USAGE}, got {uri!r}")
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    if scheme not in SCHEMES:
        raise SourceError(f"must be one of {USAGE}, got {uri!r}")
    if scheme == "oci":
        return _oci(uri)
    m = {"pvc": _PVC, "file": _FILE, "hf": _HF, "s3": _S3}[scheme].match(uri)
    if m is None:
        raise SourceError(_malformed(scheme, uri))
    if scheme == "pvc":
        return Source("pvc", uri, claim=m["claim"], path=m["path"])
    if scheme == "file":
        return Source("file", uri, path=m["path"])
    if scheme == "hf":
        if "--" in m["repo"] or ".." in m["repo"]:
            raise SourceError(f"{uri!r}: a Hub repository id has no '--' or '..'")
        return Source("hf", uri, repo=m["repo"], revision=m["revision"] or "")
    return Source("s3", uri, bucket=m["bucket"], prefix=m["prefix"].strip("/"))


def _oci(uri: str) -> Source:
    reference = uri[len("oci://") :]
    if error := image_reference_error(reference):
        raise SourceError(f"{uri!r} is not oci://REGISTRY/REPO[:TAG|@DIGEST]: {error}")
    first = REFERENCE.match(reference)["name"].split("/", 1)
    if len(first) < 2 or not ("." in first[0] or ":" in first[0] or first[0] == "localhost"):
        raise SourceError(
            f"{uri!r} names no registry: write oci://REGISTRY/REPO[:TAG|@DIGEST], e.g. oci://quay.io/org/model:1"
        )
    return Source("oci", uri, image=reference)


def _malformed(scheme: str, uri: str) -> str:
    return {
        "pvc": f"{uri!r} is not pvc://CLAIM/PATH (CLAIM: lower-case letters, digits, '-' and '.')",
        "file": f"{uri!r} is not file:///PATH (an absolute path on the node)",
        "hf": f"{uri!r} is not hf://ORG/NAME[@REVISION] (a Hub repository id, then a branch, tag or commit)",
        "s3": f"{uri!r} is not s3://BUCKET/PREFIX (a bucket name of 3-63 lower-case letters, digits, '.' "
        "and '-', then the model's folder)",
    }[scheme]
