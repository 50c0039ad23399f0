"""The kubelet stand-ins' own checks (tests/cluster/kubelet_checks.py), without a cluster: the image reference
grammar as the kubelet parses it (distribution/reference's normalizing parse, go-digest's digest checks),
init containers checked first, and `runAsNonRoot` against the user an image runs as."""

from __future__ import annotations

import pytest
from kubernetes import client

from tests.cluster.kubelet_checks import image_user, parse_image_reference, start_blocker, waiting_status

HEX64 = "0123456789abcdef" * 4
# (reference, the full name the kubelet reads, tag, digest)
PARSED = [
    ("runtime", "docker.io/library/runtime", "", ""),
    ("nginx:1.27", "docker.io/library/nginx", "1.27", ""),
    ("index.docker.io/nginx", "docker.io/library/nginx", "", ""),
    ("team/runtime", "docker.io/team/runtime", "", ""),
    ("quay.io/spyre-serve/runtime:0.1.0", "quay.io/spyre-serve/runtime", "0.1.0", ""),
    (f"quay.io/spyre-serve/runtime@sha256:{HEX64}", "quay.io/spyre-serve/runtime", "", f"sha256:{HEX64}"),
    (f"quay.io/a/b:v1@sha512:{HEX64 * 2}", "quay.io/a/b", "v1", f"sha512:{HEX64 * 2}"),
    ("localhost/runtime:dev", "localhost/runtime", "dev", ""),  # localhost is a registry, not a user
    (f"localhost:5000/a/b:v1@sha256:{HEX64}", "localhost:5000/a/b", "v1", f"sha256:{HEX64}"),
    ("registry:5000/runtime", "registry:5000/runtime", "", ""),  # a port makes it a registry
    ("runtime:5000", "docker.io/library/runtime", "5000", ""),  # ... but not without a slash: a tag
    ("[::1]:5000/runtime:1", "[::1]:5000/runtime", "1", ""),
    ("Registry.Example.com/team/model_car__x:latest", "Registry.Example.com/team/model_car__x", "latest", ""),
    ("Spyre/runtime", "Spyre/runtime", "", ""),  # a capital makes the first part a registry host
    ("a-b.c_d/e--f:T_A.G-1", "a-b.c_d/e--f", "T_A.G-1", ""),  # no valid host: all of it is the path
]
# (reference, what the parse says)
REFUSED = [
    ("", "invalid reference format"),
    ("spyre serve/runtime", "invalid reference format"),
    ("runtime:", "invalid reference format"),
    ("-runtime", "invalid reference format"),
    ("a___b", "invalid reference format"),
    ("registry:http/runtime", "invalid reference format"),  # a port is digits
    ("runtime:" + "t" * 129, "invalid reference format"),  # a tag has at most 128 characters
    ("quay.io/Spyre/runtime", "repository name (Spyre/runtime) must be lowercase"),
    ("UPPER", "repository name (library/UPPER) must be lowercase"),
    ("localhost/Runtime:1", "repository name (Runtime) must be lowercase"),
    (HEX64, "cannot specify 64-byte hexadecimal strings"),
    ("runtime@sha256:abc", "invalid reference format"),  # under 32 hex digits: no digest at all
    ("runtime@sha256:" + "a" * 40, "invalid checksum digest length"),
    ("runtime@sha256:" + HEX64.upper(), "invalid checksum digest format"),  # hex digests are lowercase
    ("runtime@md5:" + "a" * 32, "unsupported digest algorithm"),
    ("[::ffff:10.0.0.1]:5000/runtime", "invalid reference format"),  # an IPv6 host in brackets: no dots
    ("x/" + "y" * 260, "repository name must not be more than 255 characters"),
    # the length counts the name as the kubelet completes it: docker.io/library/ + 240 = 258
    ("a" * 240, "repository name must not be more than 255 characters"),
]


def pod(containers, init=(), pod_security=None) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name="p", namespace="ml", uid="u1"),
        spec=client.V1PodSpec(
            containers=list(containers),
            init_containers=list(init) or None,
            security_context=pod_security,
            node_name="spyre-node-0",
        ),
    )


def container(image: str, name: str = "runtime", **security) -> client.V1Container:
    context = client.V1SecurityContext(**security) if security else None
    return client.V1Container(name=name, image=image, security_context=context)


@pytest.mark.parametrize(("image", "name", "tag", "digest"), PARSED, ids=[p[0][:40] for p in PARSED])
def test_references_the_kubelet_accepts(image, name, tag, digest):
    assert parse_image_reference(image) == (name, tag, digest)
    assert start_blocker(None, pod([container(image)]), unpullable=set()) is None


@pytest.mark.parametrize(("image", "words"), REFUSED, ids=[r[0][:30] or "empty" for r in REFUSED])
def test_references_the_kubelet_refuses_with_its_words(image, words):
    blocked = start_blocker(None, pod([container(image)]), unpullable=set())
    assert blocked is not None and blocked[:2] == ("runtime", "InvalidImageName"), blocked
    assert blocked[2].startswith(f'Failed to apply default image tag "{image}": couldn\'t parse image')
    assert words in blocked[2], blocked[2]


def test_init_containers_are_checked_first_and_reported_as_init_statuses():
    bad_init = container("quay.io/Org/model:1", name="modelcar")
    refused = pod([container("quay.io/Org/runtime:1")], init=[bad_init])
    blocked = start_blocker(None, refused, unpullable=set())
    assert blocked[:2] == ("modelcar", "InvalidImageName") and "(Org/model)" in blocked[2]
    status = waiting_status(refused, *blocked, "2026-11-26T12:00:00Z")["status"]
    (init,) = status["initContainerStatuses"]
    assert init["state"]["waiting"]["reason"] == "InvalidImageName"
    assert status["containerStatuses"][0]["state"] == {"waiting": {"reason": "PodInitializing"}}
    assert status["conditions"][0] == {
        "type": "Initialized",
        "status": "False",
        "reason": "ContainersNotInitialized",
        "lastTransitionTime": "2026-11-26T12:00:00Z",
    }
    unpullable = pod([container("quay.io/spyre-serve/runtime:1")], init=[container("q.io/m:1", name="car")])
    assert start_blocker(None, unpullable, unpullable={"q.io/m:1"})[:2] == ("car", "ErrImagePull")


def test_the_project_images_run_as_their_containerfiles_user_and_others_as_root():
    assert image_user("quay.io/spyre-serve/runtime:0.1.0") == "1001"  # Containerfile.runtime's last USER
    assert image_user("quay.io/spyre-serve/operator:0.1.0") == "1000"
    assert image_user("registry.example.com/models/tiny:1") == ""  # FROM busybox, no USER: root
    assert (
        image_user("registry.example.com/models/tiny:1", {"registry.example.com/models/tiny:1": "app"})
        == "app"
    )


NON_ROOT = client.V1PodSecurityContext(run_as_non_root=True)
WHO = '(pod: "p_ml(u1)", container: runtime)'
# (image user, pod securityContext, container securityContext, the kubelet's refusal or None)
SECURITY = [
    ("", NON_ROOT, {}, f"container has runAsNonRoot and image will run as root {WHO}"),
    ("0:0", NON_ROOT, {}, f"container has runAsNonRoot and image will run as root {WHO}"),
    ("app", NON_ROOT, {}, "image has non-numeric user (app), cannot verify user is non-root"),
    ("1001", NON_ROOT, {}, None),
    ("", NON_ROOT, {"run_as_user": 1000}, None),  # a user set for it: the image's does not matter
    ("1001", NON_ROOT, {"run_as_user": 0}, f"container's runAsUser breaks non-root policy {WHO}"),
    ("", client.V1PodSecurityContext(run_as_non_root=True, run_as_user=65532), {}, None),
    ("", None, {"run_as_non_root": True}, "image will run as root"),  # the container's own setting
    ("", NON_ROOT, {"run_as_non_root": False}, None),  # ... which wins over the pod's
    ("", None, {}, None),  # root allowed
]


@pytest.mark.parametrize(("user", "pod_sc", "sc", "refusal"), SECURITY)
def test_run_as_non_root_against_the_images_user(user, pod_sc, sc, refusal):
    image = "registry.example.com/models/tiny:1"
    blocked = start_blocker(None, pod([container(image, **sc)], pod_security=pod_sc), set(), {image: user})
    if refusal is None:
        assert blocked is None
    else:
        assert blocked[:2] == ("runtime", "CreateContainerConfigError") and refusal in blocked[2], blocked


@pytest.mark.parametrize(
    "image", [p[0] for p in PARSED] + [r[0] for r in REFUSED], ids=lambda i: i[:30] or "empty"
)
def test_the_operator_refuses_what_the_kubelet_refuses_and_only_that(image):
    """The operator's own grammar (spyre_operator.image_reference), which refuses a spec before any pod
    exists, against the stand-in's: they must agree on every reference of the tables."""
    from spyre_contract.image_reference import image_reference_error

    kubelet = start_blocker(None, pod([container(image)]), unpullable=set())
    assert (image_reference_error(image) is None) == (kubelet is None), (
        image_reference_error(image),
        kubelet,
    )
