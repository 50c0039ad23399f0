"""The images the real node runs, and where tests/cluster/build-images.sh caches them (issue 34).

Each project image is tagged by the content it is built from (its Containerfile, pyproject.toml,
constraints.txt, README.md and the Python packages), so a build is reused exactly while that content is the
same and a changed tree gets a new image. Stdlib only: build-images.sh runs it with the machine's python3.

    python3 tests/cluster/images.py ref runtime     # spyre-serve/runtime:0.1.0-<content hash>
    python3 tests/cluster/images.py cached runtime  # exit 0 when the local registry's storage holds it

Test infrastructure, never shipped.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAUSE_REF = "spyre-serve/pause:3.4.1"
# the base's tag names what it holds (bookworm-2: with g++ and python3-dev); it is part of every project
# image's content hash, so a new base rebuilds the images on it
BASE_REF = "spyre-serve/debian-python:bookworm-2"
# The name pods use for the local registry; the node's containerd maps it to 127.0.0.1:<port> (hosts.toml),
# so no image name carries a port and nothing resolves it through DNS.
REGISTRY_HOST = "registry.spyre.test"
_SOURCES = {
    "runtime": ("Containerfile.runtime", "runtime", "contract", "operator"),
    "operator": ("Containerfile", "runtime", "contract", "operator"),
    # a modelcar: the seeded tiny model (`spyre-runtime tiny-model`) in /models of a small image
    "tiny-model": (
        "runtime/spyre_runtime/testing/models.py",
        "runtime/spyre_runtime/testing/tiny_models.py",
        "tests/cluster/build-images.sh",
    ),
}
_COMMON = ("pyproject.toml", "constraints.txt", "README.md")


def cache_root() -> Path:
    env = os.environ.get("SPYRE_K8S_CACHE")
    return Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "spyre-serve")


def registry_storage() -> Path:
    return cache_root() / "registry"


def _files(kind: str) -> list[Path]:
    found = []
    for name in (*_COMMON, *_SOURCES[kind]):
        path = REPO / name
        if path.is_dir():
            found += [
                p
                for p in path.rglob("*")
                if p.is_file() and "__pycache__" not in p.parts and ".egg-info" not in str(p)
            ]
        else:
            found.append(path)
    return sorted(found)


def ref(kind: str) -> str:
    """`spyre-serve/<kind>:<version>-<content hash>` for "runtime", "operator" or "tiny-model"; PAUSE_REF
    for "pause"."""
    if kind == "pause":
        return PAUSE_REF
    if kind not in _SOURCES:
        raise ValueError(f"unknown image kind {kind!r}: expected runtime, operator, tiny-model or pause")
    digest = hashlib.sha256(BASE_REF.encode() + b"\0")
    for path in _files(kind):
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    return f"spyre-serve/{kind}:{version}-{digest.hexdigest()[:12]}"


def pod_image(kind: str) -> str:
    """The name a pod spec uses: the image on the local registry."""
    return f"{REGISTRY_HOST}/{ref(kind)}"


def cached(kind: str) -> bool:
    """True when the registry's storage holds the tag (the registry need not run to tell)."""
    repo, tag = ref(kind).split(":")
    link = (
        registry_storage()
        / "docker/registry/v2/repositories"
        / repo
        / "_manifests/tags"
        / tag
        / "current/link"
    )
    return link.is_file()


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("ref", "cached"):
        print("usage: images.py ref|cached runtime|operator|tiny-model|pause", file=sys.stderr)
        return 2
    try:
        if argv[0] == "ref":
            print(ref(argv[1]))
            return 0
        return 0 if cached(argv[1]) else 1
    except ValueError as e:
        print(f"images.py: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
