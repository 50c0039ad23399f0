"""Container image references, as the kubelet parses them (the distribution/reference grammar that
containerd and CRI-O use): `[DOMAIN[:PORT]/]PATH[:TAG][@DIGEST]`. A pod whose image does not parse never
starts (the kubelet reports `InvalidImageName`), so the operator refuses such a spec before any pod exists."""

from __future__ import annotations

import re

_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|[-]+)"
_PATH_COMPONENT = rf"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[0-9a-fA-F:.]+\])(?::[0-9]+)?"
_NAME = rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
REFERENCE = re.compile(rf"^(?P<name>{_NAME})(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?$")
MAX_NAME_LENGTH = 255


def image_reference_error(image: str) -> str | None:
    """None for a reference the kubelet accepts, else what is wrong with it (the runtime's own words)."""
    m = REFERENCE.match(image)
    what = f'couldn\'t parse image reference "{image}": invalid reference format'
    if m is None:
        if image.lower() != image and REFERENCE.match(image.lower()):
            return f"{what}: repository name must be lowercase"
        return what
    if len(m["name"]) > MAX_NAME_LENGTH:
        return f"{what}: repository name must not be more than {MAX_NAME_LENGTH} characters"
    return None
