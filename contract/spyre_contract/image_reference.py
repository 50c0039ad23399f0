"""Container image references, as the kubelet parses them (the distribution/reference grammar that
containerd and CRI-O use): `[DOMAIN[:PORT]/]PATH[:TAG][@DIGEST]`. A pod whose image does not parse never
starts (the kubelet reports `InvalidImageName`), so the operator refuses such a spec before any pod exists."""

from __future__ import annotations

import re

_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|[-]+)"
_PATH_COMPONENT = rf"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
_NAME = rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
REFERENCE = re.compile(rf"^(?P<name>{_NAME})(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?$")
MAX_NAME_LENGTH = 255
DIGEST_HEX_LENGTHS = {"sha256": 64, "sha384": 96, "sha512": 128}  # the algorithms the runtimes verify


def _full_name(name: str) -> str:
    """The name as the kubelet completes it before counting its length: Docker Hub's `docker.io/` (and
    `library/` for a one-part name) when the first part is not a registry."""
    first, slash, _ = name.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost" or first != first.lower()):
        return name
    return f"docker.io/{name if slash else 'library/' + name}"


def _digest_error(digest: str) -> str | None:
    algorithm, _, hex_digits = digest.partition(":")
    if algorithm not in DIGEST_HEX_LENGTHS:
        return "unsupported digest algorithm"
    if len(hex_digits) != DIGEST_HEX_LENGTHS[algorithm]:
        return "invalid checksum digest length"
    return None if hex_digits == hex_digits.lower() else "invalid checksum digest format"


def image_reference_error(image: str) -> str | None:
    """None for a reference the kubelet accepts, else what is wrong with it (the runtime's own words)."""
    m = REFERENCE.match(image)
    what = f'couldn\'t parse image reference "{image}": invalid reference format'
    if re.fullmatch("[a-f0-9]{64}", image):
        return f"{what}: a 64-hex-digit image ID is not a repository name"
    if m is None:
        if image.lower() != image and REFERENCE.match(image.lower()):
            return f"{what}: repository name must be lowercase"
        return what
    if len(_full_name(m["name"])) > MAX_NAME_LENGTH:
        return f"{what}: repository name must not be more than {MAX_NAME_LENGTH} characters"
    if m["digest"] and (error := _digest_error(m["digest"])):
        return f'couldn\'t parse image reference "{image}": {error}'
    return None
