"""What a kubelet checks before it starts a container, for both stand-ins (the status-only FakeKubelet and the
process-running PodRunner). Init containers are checked first, in order, then the containers. A pod that fails
a check stays Pending with that container waiting, the reason and message a kubelet gives, and is checked
again on the next pass (a Secret created later lets it start):

- `InvalidImageName`: the image reference does not parse. The grammar is this module's own
  (`parse_image_reference`: distribution/reference's normalizing parse and go-digest's digest checks, as the
  kubelet calls them), never the operator's, so the two can disagree and a test can see it;
- `ErrImagePull`: the test marked the image unpullable (there is no registry here);
- `CreateContainerConfigError`: an env `valueFrom` or `envFrom` names a Secret or ConfigMap (or a key of one)
  that does not exist and is not `optional`; or `runAsNonRoot` (the container's, else the pod's) while the
  container would run as root: `runAsUser: 0`, or no `runAsUser` and an image whose user is root (no USER
  line: `image_user`) or a name that cannot be verified.
"""

from __future__ import annotations

import re
from pathlib import Path

from kubernetes import client
from kubernetes.client.rest import ApiException

REPO = Path(__file__).resolve().parents[2]

# ---- image references -------------------------------------------------------------------------------
# reference := name [":" tag] ["@" digest];  name := [domain "/"] component ("/" component)*
# domain := host [":" port];  host := label ("." label)* | "[" ipv6 "]"
# component := [a-z0-9]+ (("." | "_" | "__" | "-"+) [a-z0-9]+)*;  tag := [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}
# digest := algorithm ":" hex;  algorithm := [A-Za-z][A-Za-z0-9]* ([-_+.] [A-Za-z][A-Za-z0-9]*)*
_LABEL = "[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOST = rf"(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9A-Fa-f:]+\])"
_COMPONENT = "[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_NAME = rf"(?:{_HOST}(?::\d+)?/)?{_COMPONENT}(?:/{_COMPONENT})*"
_GRAMMAR = re.compile(
    rf"(?P<name>{_NAME})(?::(?P<tag>\w[\w.-]{{0,127}}))?"
    r"(?:@(?P<digest>[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9A-Fa-f]{32,}))?",
    re.ASCII,
)
_DIGEST_HEX_LENGTH = {"sha256": 64, "sha384": 96, "sha512": 128}  # the algorithms containerd links in
_DIGEST_SHAPE = re.compile(r"[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[a-zA-Z0-9=_-]+")
_DOCKER_HUB, _LEGACY_HUB, _OFFICIAL = "docker.io", "index.docker.io", "library/"
MAX_NAME = 255


class ReferenceError(ValueError):
    """Why a reference does not parse, in the words distribution/reference and go-digest use."""


def _split_domain(image: str) -> tuple[str, str]:
    """The registry and the rest, as the normalizing parse splits them: the first component is a registry
    when it has a dot or a port, is `localhost`, or has capitals; otherwise Docker Hub (and `library/` for a
    one-component name)."""
    head, slash, rest = image.partition("/")
    if not slash or ("." not in head and ":" not in head and head != "localhost" and head == head.lower()):
        head, rest = _DOCKER_HUB, image
    if head == _LEGACY_HUB:
        head = _DOCKER_HUB
    if head == _DOCKER_HUB and "/" not in rest:
        rest = _OFFICIAL + rest
    return head, rest


def _check_digest(digest: str) -> None:
    algorithm, _, hex_part = digest.partition(":")
    size = _DIGEST_HEX_LENGTH.get(algorithm)
    if size is None:
        raise ReferenceError(
            "unsupported digest algorithm"
            if _DIGEST_SHAPE.fullmatch(digest)
            else "invalid checksum digest format"
        )
    if len(hex_part) != size:
        raise ReferenceError("invalid checksum digest length")
    if not re.fullmatch("[a-f0-9]+", hex_part):
        raise ReferenceError("invalid checksum digest format")


def parse_image_reference(image: str) -> tuple[str, str, str]:
    """(full name, tag, digest) of `image` as the kubelet reads it (`nginx` is docker.io/library/nginx);
    raises ReferenceError with the parser's words when it does not parse."""
    if re.fullmatch("[a-f0-9]{64}", image):
        raise ReferenceError(f"invalid repository name ({image}), cannot specify 64-byte hexadecimal strings")
    domain, rest = _split_domain(image)
    repository = rest.split(":", 1)[0]
    if repository != repository.lower():
        raise ReferenceError(f"invalid reference format: repository name ({repository}) must be lowercase")
    full = f"{domain}/{rest}"
    match = _GRAMMAR.fullmatch(full)
    if match is None:
        if _GRAMMAR.fullmatch(full.lower()):
            raise ReferenceError("repository name must be lowercase")
        raise ReferenceError("invalid reference format")
    if len(match["name"]) > MAX_NAME:
        raise ReferenceError(f"repository name must not be more than {MAX_NAME} characters")
    if match["digest"]:
        _check_digest(match["digest"])
    return match["name"], match["tag"] or "", match["digest"] or ""


def image_name_error(image: str) -> str | None:
    """The kubelet's InvalidImageName message for `image`, or None when it parses."""
    try:
        parse_image_reference(image)
    except ReferenceError as e:
        return f'Failed to apply default image tag "{image}": couldn\'t parse image reference "{image}": {e}'
    return None


# ---- the user an image runs as ------------------------------------------------------------------------


def _containerfile_user(path: Path) -> str:
    users = re.findall(r"^USER\s+(\S+)", path.read_text(), re.M) if path.exists() else []
    return users[-1] if users else ""


# this project's images, by what their name contains (podrunner.py runs them from the venv), and the USER
# their Containerfile ends with; any other image runs as what `image_users` says, else as root (no USER line)
PROJECT_IMAGE_USERS = {
    "runtime": _containerfile_user(REPO / "Containerfile.runtime"),
    "operator": _containerfile_user(REPO / "Containerfile"),
}


def image_user(image: str, image_users: dict[str, str] | None = None) -> str:
    """The image's USER ("" is root, as an image without a USER line)."""
    if image_users and image in image_users:
        return image_users[image]
    name = image.split("@", 1)[0].rsplit("/", 1)[-1].split(":", 1)[0]
    return next((user for word, user in PROJECT_IMAGE_USERS.items() if word in name), "")


def non_root_error(pod, container, user: str) -> str | None:
    """The kubelet's refusal of a container that must not run as root but would, else None."""
    pod_sc = pod.spec.security_context
    sc = container.security_context
    non_root = next(
        (s.run_as_non_root for s in (sc, pod_sc) if s is not None and s.run_as_non_root is not None), None
    )
    if not non_root:
        return None
    meta = pod.metadata
    who = f'(pod: "{meta.name}_{meta.namespace}({meta.uid})", container: {container.name})'
    run_as = next((s.run_as_user for s in (sc, pod_sc) if s is not None and s.run_as_user is not None), None)
    if run_as is not None:
        return None if run_as != 0 else f"container's runAsUser breaks non-root policy {who}"
    uid = user.split(":", 1)[0]
    if uid in ("", "0"):
        return f"container has runAsNonRoot and image will run as root {who}"
    if not uid.isdigit():
        return (
            f"container has runAsNonRoot and image has non-numeric user ({uid}), cannot verify user is "
            f"non-root {who}"
        )
    return None


# ---- Secrets and ConfigMaps ----------------------------------------------------------------------------


def _missing(core: client.CoreV1Api, kind: str, namespace: str, name: str, key: str | None) -> str | None:
    read = core.read_namespaced_secret if kind == "Secret" else core.read_namespaced_config_map
    try:
        obj = read(name, namespace)
    except ApiException as e:
        if e.status == 404:
            return f'{kind.lower()} "{name}" not found'
        raise
    data = {**(obj.data or {}), **(getattr(obj, "binary_data", None) or {})}
    if key is not None and key not in data:
        return f"couldn't find key {key} in {kind} {namespace}/{name}"
    return None


def config_error(core: client.CoreV1Api, pod, container) -> str | None:
    """The kubelet's message for the first env source of `container` that cannot be resolved, else None."""
    ns = pod.metadata.namespace
    for env in container.env or []:
        source = env.value_from
        if source is None:
            continue
        for kind, ref in (("Secret", source.secret_key_ref), ("ConfigMap", source.config_map_key_ref)):
            if (
                ref is not None
                and not ref.optional
                and (message := _missing(core, kind, ns, ref.name, ref.key))
            ):
                return message
    for env_from in container.env_from or []:
        for kind, ref in (("Secret", env_from.secret_ref), ("ConfigMap", env_from.config_map_ref)):
            if ref is not None and not ref.optional and (message := _missing(core, kind, ns, ref.name, None)):
                return message
    return None


# ---- the checks, in a kubelet's order --------------------------------------------------------------------


def start_blocker(
    core: client.CoreV1Api, pod, unpullable: set[str], image_users: dict[str, str] | None = None
) -> tuple[str, str, str] | None:
    """(container name, waiting reason, message) of the first container, init containers first, that a
    kubelet would not start."""
    for c in [*(pod.spec.init_containers or []), *pod.spec.containers]:
        if error := image_name_error(c.image or ""):
            return c.name, "InvalidImageName", error
        if c.image in unpullable:
            reference = f'failed to resolve reference "{c.image}": not found'
            return c.name, "ErrImagePull", f'failed to pull and unpack image "{c.image}": {reference}'
        if message := non_root_error(pod, c, image_user(c.image, image_users)):
            return c.name, "CreateContainerConfigError", message
        if message := config_error(core, pod, c):
            return c.name, "CreateContainerConfigError", message
    return None


def waiting_status(pod, container: str, reason: str, message: str, now: str) -> dict:
    """The status a kubelet writes for a pod whose container cannot start: the blocked one waiting with its
    reason; when it is an init container, the containers wait on PodInitializing and the pod is not
    Initialized."""
    blocked = {"waiting": {"reason": reason, "message": message}}
    in_init = any(c.name == container for c in pod.spec.init_containers or [])

    def statuses(containers, otherwise: dict) -> list[dict]:
        return [
            {
                "name": c.name,
                "image": c.image,
                "imageID": "",
                "ready": False,
                "restartCount": 0,
                "state": blocked if c.name == container else otherwise,
            }
            for c in containers
        ]

    initializing = {"waiting": {"reason": "PodInitializing"}}
    status = {
        "phase": "Pending",
        "startTime": now,
        "conditions": [
            {"type": "Initialized", "status": "False" if in_init else "True", "lastTransitionTime": now},
            {
                "type": "ContainersReady",
                "status": "False",
                "reason": "ContainersNotReady",
                "lastTransitionTime": now,
            },
            {"type": "Ready", "status": "False", "reason": "ContainersNotReady", "lastTransitionTime": now},
        ],
        "containerStatuses": statuses(pod.spec.containers, initializing),
    }
    if in_init:  # (a container blocked after its init containers: they are not reported, never having run)
        status["initContainerStatuses"] = statuses(pod.spec.init_containers, initializing)
        status["conditions"][0]["reason"] = "ContainersNotInitialized"
    return {"status": status}


def waiting_reason(pod) -> str | None:
    """The reason the first waiting container (init containers first) of `pod`'s status gives."""
    status = pod.status
    for cs in [*(status.init_container_statuses or []), *(status.container_statuses or [])]:
        if cs.state and cs.state.waiting and cs.state.waiting.reason != "PodInitializing":
            return cs.state.waiting.reason
    return None
