"""The API as users meet it: kubectl explain, schema defaults and validation, least-privilege RBAC."""

import pytest
from kubernetes import client

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
    from spyre_operator.spec.parse import parse_spec

    ok = ns.apply_model(
        "d", {"model": {"source": "file:///models/x"}, "batching": {"maxModelLen": 256, "maxNumSeqs": 4}}
    )
    spec = ok["spec"]
    assert (spec["cards"], spec["replicas"], spec["backend"], spec["task"]) == (1, 1, "sendnn", "generate")
    # no default for batching.mode: the operator runs the task's (continuous for generate, static for pooling)
    assert spec["batching"] == {"maxModelLen": 256, "maxNumSeqs": 4}
    assert parse_spec("d", spec).mode == "continuous"
    shapes = [{"promptLength": 64, "batchSize": 2}]
    pooling = ns.apply_model(
        "p", {"model": {"source": "file:///models/x"}, "task": "embed", "batching": {"shapes": shapes}}
    )
    assert "mode" not in pooling["spec"]["batching"] and parse_spec("p", pooling["spec"]).mode == "static"
    with pytest.raises(Exception, match=r"spec\.cards"):
        ns.apply_model("e", {"model": {"source": "file:///x"}, "cards": 3})
    with pytest.raises(Exception, match=r"spec\.model\.source"):
        ns.apply_model("f", {"model": {"source": "http://hub/model"}})


# kubectl 1.20 cannot name a resource its API server does not serve (the InferencePool CRD is installed only
# for the tests that need it): for those the API server's SubjectAccessReview is asked, as kubectl would
UNSERVED_GROUPS = ("inference.networking.k8s.io", "gateway.networking.k8s.io")


def reviewed(kube, user: str, verb: str, resource: str, sub: str, namespace: str) -> bool:
    name, _, group = resource.partition(".")
    groups = [
        "system:serviceaccounts",
        f"system:serviceaccounts:{user.split(':')[2]}",
        "system:authenticated",
    ]
    attributes = {"namespace": namespace, "verb": verb, "group": group, "resource": name, "subresource": sub}
    body = {"spec": {"user": user, "groups": groups, "resourceAttributes": attributes}}
    return client.AuthorizationV1Api(kube).create_subject_access_review(body).status.allowed


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
        # the Secrets models' pods read (spec.auth, spec.tls): read, checked and digested, never written
        ("get", "secrets", True),
        ("watch", "secrets", True),
        ("create", "secrets", False),
        ("patch", "secrets", False),
        # token authorization (spec.auth.kubernetes): a ClusterRoleBinding per model, removed with it
        ("create", "clusterrolebindings.rbac.authorization.k8s.io", True),
        ("delete", "clusterrolebindings.rbac.authorization.k8s.io", True),
        ("patch", "clusterrolebindings.rbac.authorization.k8s.io", False),
        ("bind", "clusterroles.rbac.authorization.k8s.io", False),
        ("create", "deployments.apps", False),
        ("delete", "services", False),
        ("patch", "nodes", False),
        ("delete", "persistentvolumeclaims", False),
        ("create", "inferencepools.inference.networking.k8s.io", True),
        ("patch", "inferencepools.inference.networking.k8s.io", True),
        ("delete", "inferencepools.inference.networking.k8s.io", True),
        ("watch", "inferencepools.inference.networking.k8s.io", True),
        ("update", "inferencepools.inference.networking.k8s.io", False),
        ("update", "inferencepools.inference.networking.k8s.io/status", False),
        ("patch", "inferencepools.inference.networking.k8s.io/status", False),
        ("create", "httproutes.gateway.networking.k8s.io", False),
        # the model loader's identity (hf://, s3://): made per model; what it grants, the operator holds
        ("create", "serviceaccounts", True),
        ("create", "roles.rbac.authorization.k8s.io", True),
        ("create", "rolebindings.rbac.authorization.k8s.io", True),
        ("patch", "pods", True),
        ("get", "pods", True),
        ("delete", "serviceaccounts", False),
        ("patch", "roles.rbac.authorization.k8s.io", False),
        ("create", "clusterroles.rbac.authorization.k8s.io", False),
        ("escalate", "roles.rbac.authorization.k8s.io", False),
        ("bind", "roles.rbac.authorization.k8s.io", False),
    ],
)
def test_operator_service_account_is_least_privilege(cluster, kube, operator_rbac, verb, resource, allowed):
    resource, _, sub = resource.partition("/")  # `kubectl auth can-i VERB RES/NAME` names an object
    if resource.partition(".")[2] in UNSERVED_GROUPS:
        assert reviewed(kube, operator_rbac, verb, resource, sub, "some-team") == allowed
        return
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


@pytest.mark.parametrize(("role", "allowed"), [("system:auth-delegator", "yes"), ("cluster-admin", "no")])
def test_operator_may_bind_only_the_auth_delegator_role(cluster, operator_rbac, role, allowed):
    """Token authorization binds each such model's ServiceAccount to system:auth-delegator: the operator
    holds `bind` on that ClusterRole by name, and on no other."""
    res = kubectl(
        cluster,
        "auth",
        "can-i",
        "bind",
        f"clusterroles.rbac.authorization.k8s.io/{role}",
        f"--as={operator_rbac}",
        check=False,
    )
    assert res.stdout.strip() == allowed, res.stdout + res.stderr


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
        kubectl(cluster, "auth", "can-i", "get", "secrets", who, "-n", "default", check=False).stdout.strip()
        == "no"
    )
    assert kubectl(cluster, "auth", "can-i", "get", "secrets", who, "-n", ns.name).stdout.strip() == "yes"
    delegator = "clusterroles.rbac.authorization.k8s.io/system:auth-delegator"
    assert kubectl(cluster, "auth", "can-i", "bind", delegator, who).stdout.strip() == "yes"
