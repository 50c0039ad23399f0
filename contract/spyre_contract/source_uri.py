"""The one grammar of a model source URI (a SpyreModel's spec.model.source), shared by the operator (which
checks a spec before anything is made for it) and the runtime's loader (`spyre-runtime fetch-model`, which
downloads hf:// and s3:// sources). The CRD's pattern and CEL rules state the same (a table test holds the
three to the same answers).

- `pvc://CLAIM/PATH`: a folder on a PersistentVolumeClaim (CLAIM a DNS name; PATH may be empty: the root);
- `file:///PATH`: an absolute folder on the node;
- `oci://REGISTRY/REPO[:TAG|@DIGEST]`: a model image, a reference the kubelet parses, with a registry;
- `hf://ORG/NAME[@REVISION]`: a Hugging Face Hub repository. ORG and NAME are the Hub's id rules (letters,
  digits, '-', '_', '.'; 1-96 characters, starting and ending with a letter or digit; no '--' or '..');
  without `@REVISION` the Hub's default revision, `main`, is meant (as the Hub's own clients do);
- `s3://BUCKET/PREFIX`: the model's folder in an S3-compatible bucket. BUCKET is S3's bucket name rule
  (3-63 lower-case letters, digits, '.' and '-'); PREFIX is required (a bucket alone would download whatever
  else it holds) and a trailing '/' is dropped."""

from __future__ import annotations

import re
from dataclasses import dataclass

from spyre_contract.image_reference import REFERENCE, image_reference_error

SCHEMES = ("pvc", "file", "oci", "hf", "s3")
DOWNLOADED = ("hf", "s3")  # downloaded by the loader into the model cache
USAGE = "pvc://CLAIM/PATH, file:///PATH, oci://REGISTRY/REPO[:TAG|@DIGEST], hf://ORG/NAME[@REVISION] or s3://BUCKET/PREFIX"
DEFAULT_REVISION = "main"  # the Hub's default revision: what hf://ORG/NAME means

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
    """A source URI does not parse; the message says what is wrong with it."""


@dataclass(frozen=True)
class SourceURI:
    """A parsed source URI: its scheme and the parts that scheme has (the others empty)."""

    scheme: str
    uri: str
    claim: str = ""  # pvc: the claim
    path: str = ""  # pvc: the folder in the claim; file: the folder on the node
    image: str = ""  # oci: the model image's reference
    repo: str = ""  # hf: ORG/NAME
    revision: str = ""  # hf: a branch, tag or commit (DEFAULT_REVISION when the URI names none)
    bucket: str = ""  # s3
    prefix: str = ""  # s3: the model's folder in the bucket, without a trailing '/'

    @property
    def is_downloaded(self) -> bool:
        """hf:// and s3://: the loader downloads them."""
        return self.scheme in DOWNLOADED


def parse_source_uri(uri: str) -> SourceURI:
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
        return SourceURI("pvc", uri, claim=m["claim"], path=m["path"])
    if scheme == "file":
        return SourceURI("file", uri, path=m["path"])
    if scheme == "hf":
        if "--" in m["repo"] or ".." in m["repo"]:
            raise SourceError(f"{uri!r}: a Hub repository id has no '--' or '..'")
        return SourceURI("hf", uri, repo=m["repo"], revision=m["revision"] or DEFAULT_REVISION)
    return SourceURI("s3", uri, bucket=m["bucket"], prefix=m["prefix"].strip("/"))


def _oci(uri: str) -> SourceURI:
    reference = uri[len("oci://") :]
    if error := image_reference_error(reference):
        raise SourceError(f"{uri!r} is not oci://REGISTRY/REPO[:TAG|@DIGEST]: {error}")
    first = REFERENCE.match(reference)["name"].split("/", 1)
    if len(first) < 2 or not ("." in first[0] or ":" in first[0] or first[0] == "localhost"):
        raise SourceError(
            f"{uri!r} names no registry: write oci://REGISTRY/REPO[:TAG|@DIGEST], e.g. oci://quay.io/org/model:1"
        )
    return SourceURI("oci", uri, image=reference)


def _malformed(scheme: str, uri: str) -> str:
    return {
        "pvc": f"{uri!r} is not pvc://CLAIM/PATH (CLAIM: lower-case letters, digits, '-' and '.')",
        "file": f"{uri!r} is not file:///PATH (an absolute path on the node)",
        "hf": f"{uri!r} is not hf://ORG/NAME[@REVISION] (a Hub repository id, then a branch, tag or commit)",
        "s3": f"{uri!r} is not s3://BUCKET/PREFIX (a bucket name of 3-63 lower-case letters, digits, '.' "
        "and '-', then the model's folder)",
    }[scheme]
