"""The API as users meet it: kubectl explain, schema defaults and validation, least-privilege RBAC."""

import pytest

from tests.conftest import REPO, kubectl, wait_for

pytestmark = pytest.mark.cluster


def test_kubectl_explain_shows_descriptions(cluster, crd):
    # the API server publishes a new CRD's OpenAPI schema a few seconds after it is established
    explain = lambda field: kubectl(cluster, "explain", field, check=False).stdout  # noqa: E731
    out = wait_for(lambda: explain("spyremodels.spec.cards"), what="the CRD's published schema")
    assert "tensor-parallel size" in out
    out = kubectl(cluster, "explain", "spyremodels.spec.batching.shapes").stdout
    assert "promptLength" in out


def test_schema_defaults_and_rejects(cluster, crd, ns):
    ok = ns.apply_model(
        "d",
        {
            "model": {"source": "file:///models/x"},
            "batching": {"shapes": [{"promptLength": 64, "newTokens": 8, "batchSize": 1}]},
        },
    )
    spec = ok["spec"]
    assert (spec["cards"], spec["replicas"], spec["backend"], spec["batching"]["mode"]) == (
        1,
        1,
        "sendnn",
        "static",
    )
    with pytest.raises(Exception, match=r"spec\.cards"):
        ns.apply_model("e", {"model": {"source": "file:///x"}, "cards": 3})
    with pytest.raises(Exception, match=r"spec\.model\.source"):
        ns.apply_model("f", {"model": {"source": "http://hub/model"}})


@pytest.mark.parametrize(
    ("verb", "resource", "allowed"),
    [
        ("watch", "spyremodels.spyre-serve.io", True),
        ("update", "spyremodels.spyre-serve.io/status", True),
        ("patch", "spyremodels.spyre-serve.io/status", False),
        ("patch", "spyremodels.spyre-serve.io", False),
        ("update", "spyremodels.spyre-serve.io/finalizers", True),
        ("get", "nodes", True),
        ("create", "pods", True),
        ("delete", "pods", True),
        ("create", "services", True),
        ("create", "persistentvolumeclaims", True),
        ("create", "events", True),
        ("create", "jobs.batch", True),
        ("patch", "jobs.batch", False),
        ("get", "secrets", False),
        ("list", "secrets", False),
        ("create", "deployments.apps", False),
        ("delete", "services", False),
        ("patch", "nodes", False),
        ("delete", "persistentvolumeclaims", False),
    ],
)
def test_operator_service_account_is_least_privilege(cluster, operator_rbac, verb, resource, allowed):
    resource, _, sub = resource.partition("/")  # `kubectl auth can-i VERB RES/NAME` names an object
    extra = [f"--subresource={sub}"] if sub else []
    res = kubectl(
        cluster,
        "auth",
        "can-i",
        verb,
        resource,
        *extra,
        f"--as={operator_rbac}",
        "-n",
        "some-team",
        check=False,
    )
    assert res.stdout.strip() == ("yes" if allowed else "no"), res.stdout + res.stderr


def test_namespaced_role_variant(cluster, kube, crd, ns):
    manifest = (REPO / "deploy/rbac/role.yaml").read_text().replace("NAMESPACE", ns.name)
    path = REPO / "tests" / f".role-{ns.name}.yaml"
    try:
        path.write_text(manifest)
        kubectl(cluster, "apply", "-f", str(path))
    finally:
        path.unlink(missing_ok=True)
    who = f"--as=system:serviceaccount:{ns.name}:spyre-operator"
    assert kubectl(cluster, "auth", "can-i", "create", "pods", who, "-n", ns.name).stdout.strip() == "yes"
    assert (
        kubectl(cluster, "auth", "can-i", "create", "pods", who, "-n", "default", check=False).stdout.strip()
        == "no"
    )
    assert (
        kubectl(cluster, "auth", "can-i", "get", "secrets", who, "-n", ns.name, check=False).stdout.strip()
        == "no"
    )
