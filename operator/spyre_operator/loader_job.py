"""Pure builders of the model loader: the Job that downloads an hf:// or s3:// model into the model cache (one
per fetch key, as the compile Job is one per cache key), and the ServiceAccount, Role and RoleBinding its pod
runs as, one set per model and owned by it (the loader patches its own pod's progress annotation, so it may
get and patch pods of the model's namespace, nothing else).

The loader's contract (`spyre-runtime fetch-model --source URI --into DIR [--endpoint URL]`): it stages in
`DIR.partial` and renames, so DIR is whole or absent; exit 0 done (also when DIR was complete already: it
prints `cached: DIR`), 1 transient (the Job retries with Kubernetes' back-off, `backoffLimit`), 2 permanent
(bad credentials, a missing object, a bad URI, no space: the Job fails at once where the cluster has pod
failure policies, 1.26+); its last stderr line is its termination message."""

from __future__ import annotations

from spyre_operator.manifests import cache_claim_name, owner_reference, pod_security
from spyre_operator.model_spec import ModelSpec
from spyre_operator.model_volumes import CACHE_VOLUME, CONTAINER_SECURITY, cache_folder
from spyre_operator.runtime_contract import CACHE_MOUNT
from spyre_operator.settings import (
    CACHE_KEY_LABEL,
    COMPONENT_LABEL,
    FETCH_LABEL,
    MANAGED_BY,
    MODEL_LABEL,
    OperatorSettings,
)

PERMANENT_EXIT = 2  # the loader's exit code for what retrying cannot fix
# the Secret's keys the loader reads, per scheme: (key, required)
SECRET_KEYS = {
    "hf": (("HF_TOKEN", True),),
    "s3": (
        ("AWS_ACCESS_KEY_ID", True),
        ("AWS_SECRET_ACCESS_KEY", True),
        ("AWS_SESSION_TOKEN", False),
        ("AWS_REGION", False),
    ),
}


def loader_job_name(name: str, key: str) -> str:
    return f"{name[:40]}-fetch-{key[:10]}"


def loader_account_name(name: str) -> str:
    return f"{name[:50]}-loader"


def _meta(model: dict, name: str) -> dict:
    model_name = model["metadata"]["name"]
    return {
        "name": name,
        "namespace": model["metadata"]["namespace"],
        "labels": {MODEL_LABEL: model_name, COMPONENT_LABEL: "model-loader", **MANAGED_BY},
        "ownerReferences": [owner_reference(model)],
    }


def build_loader_access(model: dict) -> list[dict]:
    """The loader pod's identity: a ServiceAccount, a Role that may get and patch pods (its own progress
    annotation) and their binding, all named `<model>-loader` and owned by the model."""
    name = loader_account_name(model["metadata"]["name"])
    namespace = model["metadata"]["namespace"]
    rbac = "rbac.authorization.k8s.io"
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(model, name)},
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "Role",
            "metadata": _meta(model, name),
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"]}],
        },
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "RoleBinding",
            "metadata": _meta(model, name),
            "roleRef": {"apiGroup": rbac, "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        },
    ]


def loader_env(spec: ModelSpec) -> list[dict]:
    """Its own pod's name and namespace (for the progress annotation) and the credentials of
    spec.model.secretRef, key by key."""
    env = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    if spec.secret_ref:
        for key, required in SECRET_KEYS[spec.model_source.scheme]:
            ref = {"name": spec.secret_ref, "key": key, **({} if required else {"optional": True})}
            env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    return env


def build_loader_job(model: dict, spec: ModelSpec, settings: OperatorSettings, key: str) -> dict:
    """The Job that fills `models/<key>` of the graph-cache claim with the model, then ends."""
    name = model["metadata"]["name"]
    labels = {FETCH_LABEL: name, CACHE_KEY_LABEL: key, COMPONENT_LABEL: "model-loader", **MANAGED_BY}
    args = ["fetch-model", "--source", spec.source, "--into", f"{CACHE_MOUNT}/{cache_folder(spec)}"]
    if spec.endpoint:
        args += ["--endpoint", spec.endpoint]
    container = {
        "name": "fetch",
        "image": spec.image or settings.runtime_image,
        "command": ["spyre-runtime"],
        "args": args,
        "env": loader_env(spec),
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}},
        "volumeMounts": [
            {"name": CACHE_VOLUME, "mountPath": CACHE_MOUNT},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        # the loader's last stderr line (one sentence) becomes the termination message, and the condition's
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": dict(CONTAINER_SECURITY),
    }
    pod_spec = {
        "containers": [container],
        "volumes": [
            {"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": cache_claim_name(name, spec)}},
            {"name": "tmp", "emptyDir": {}},
        ],
        "restartPolicy": "Never",
        "serviceAccountName": loader_account_name(name),
        "enableServiceLinks": False,
        "securityContext": pod_security(settings),
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.tolerations]
    permanent = {"containerName": "fetch", "operator": "In", "values": [PERMANENT_EXIT]}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {**_meta(model, loader_job_name(name, key)), "labels": labels},
        "spec": {
            "backoffLimit": settings.loader_retries,
            # exit 2 is permanent: no retry (clusters without pod failure policies retry it, harmlessly)
            "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": permanent}]},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }
