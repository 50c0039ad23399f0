"""Image references as the kubelet parses them (distribution/reference): what runs, what never starts."""

import pytest
from spyre_contract.image_reference import image_reference_error

DIGEST = "sha256:" + "0123456789abcdef" * 4
ACCEPTED = [
    "runtime",
    "quay.io/spyre-serve/runtime:0.1.0",
    f"quay.io/spyre-serve/runtime@{DIGEST}",
    f"localhost:5000/a/b:v1@{DIGEST}",
    "[::1]:5000/runtime:1",
    "Registry.Example.com/team/model_car__x:latest",  # the domain may have capitals, the path may not
    "a-b.c_d/e--f:T_A.G-1",
]
REFUSED = [
    ("", "invalid reference format"),
    ("spyre serve/runtime", "invalid reference format"),
    ("runtime:", "invalid reference format"),
    ("runtime@sha256:abc", "invalid reference format"),  # digest too short
    ("quay.io/Spyre/runtime", "repository name must be lowercase"),
    ("-runtime", "invalid reference format"),
    ("a___b", "invalid reference format"),
    ("runtime:" + "t" * 129, "invalid reference format"),  # tags have at most 128 characters
    ("x/" + "y" * 260, "must not be more than 255 characters"),
    ("a" * 240, "must not be more than 255 characters"),  # counted as docker.io/library/aaa...
    ("runtime@sha256:" + "a" * 40, "invalid checksum digest length"),
    ("runtime@sha256:" + "0123456789ABCDEF" * 4, "invalid checksum digest format"),
    ("runtime@md5:" + "a" * 32, "unsupported digest algorithm"),
    ("[::ffff:10.0.0.1]:5000/runtime", "invalid reference format"),
    ("0123456789abcdef" * 4, "is not a repository name"),
]


@pytest.mark.parametrize("image", ACCEPTED)
def test_references_the_kubelet_accepts(image):
    assert image_reference_error(image) is None


@pytest.mark.parametrize(("image", "message"), REFUSED, ids=[r[0][:30] or "empty" for r in REFUSED])
def test_references_the_kubelet_refuses(image, message):
    error = image_reference_error(image)
    assert error is not None and message in error and f'"{image}"' in error
