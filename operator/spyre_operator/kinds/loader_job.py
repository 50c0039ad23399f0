"""The model cache of a downloaded model (hf://, s3://): the loader's ServiceAccount, Role and RoleBinding
(made once per model), then one loader Job per fetch key that fills `models/<key>` of the graph-cache claim.
The pods and the compile Job wait until it succeeded; while it runs the model is looked at again every few
seconds for the loader's progress; once it succeeded, the Jobs of older keys are removed. A failed Job (its
retries spent, or the loader's permanent exit code) stays until a human deletes it: the model is Stalled
with the loader's last words. The builders (the Job, its pod's identity) and what is read off the Job and
its pods (a ModelCacheState) are here too.

The loader Job is one per fetch key, as the compile Job is one per cache key; its pod runs as the
ServiceAccount, Role and RoleBinding made once per model and owned by it (the loader patches its own pod's
progress annotation, so it may get and patch pods of the model's namespace, nothing else).

The loader's contract (`spyre-runtime fetch-model --source URI --into DIR [--endpoint URL]`): it stages in
`DIR.partial` and renames, so DIR is whole or absent; exit 0 done (also when DIR was complete already: it
prints `cached: DIR`), 1 transient (the Job retries with Kubernetes' back-off, `backoffLimit`), 2 permanent
(bad credentials, a missing object, a bad URI, no space: the Job fails at once where the cluster has pod
failure policies, 1.26+); its last stderr line is its termination message."""

from __future__ import annotations

from dataclasses import dataclass

from kubernetes.client.rest import ApiException

from spyre_operator.io.events import EventRecorder
from spyre_operator.io.kube import Kube, problem_of
from spyre_operator.io.work import Pass
from spyre_operator.kinds.graph_cache_claim import cache_claim_name
from spyre_operator.kinds.ownership import owner_reference
from spyre_operator.kinds.pods.observe import STUCK_REASONS, last_line
from spyre_operator.settings import (
    CACHE_KEY_LABEL,
    COMPONENT_LABEL,
    CONTAINER_SECURITY,
    FETCH_LABEL,
    MANAGED_BY,
    MODEL_LABEL,
    PROGRESS_ANNOTATION,
    OperatorSettings,
    pod_security,
)
from spyre_operator.spec.model_source import CACHE_VOLUME
from spyre_operator.spec.model_spec import ModelSpec
from spyre_operator.spec.runtime_contract import CACHE_MOUNT


@dataclass(frozen=True)
class ModelCacheState:
    """The loader Job of the current fetch key (hf://, s3://), as observed: downloading (bytes so far, from
    its pod's progress annotation), cached, or failed for good (the loader's last words)."""

    key: str
    is_ready: bool
    is_failed: bool
    reason: str  # Downloading | Cached | DownloadFailed
    message: str


# what a failed download's condition points at, for a store the cluster cannot reach (offline, a proxy)
UNREACHABLE = (
    "where the store cannot be reached from the cluster, set spec.model.endpoint to a mirror it can reach, "
    "or serve the model from a pvc:// claim or an oci:// image"
)
PROGRESS_SECONDS = 2.0  # how often a download's progress is read into the status
# what holds the pods of a downloaded model whose loader Job could not be read this pass
UNREAD = ModelCacheState("", False, False, "Downloading", "the loader Job could not be read")


class LoaderJobStep:
    def __init__(self, settings: OperatorSettings, kube: Kube, events: EventRecorder) -> None:
        self.settings = settings
        self.kube = kube
        self.events = events
        self._has_access: set[tuple[str, str]] = set()  # (namespace, model uid): the loader's RBAC is made
        # model key -> (the uid of the loader Job that succeeded, what it cached): a Job that succeeded stays
        # so, and its pods' words and progress are read once, not at every pass
        self._cached: dict[tuple[str, str], tuple[str, ModelCacheState]] = {}

    def ensure(self, model: dict, spec: ModelSpec, work: Pass) -> ModelCacheState | None:
        """The current fetch key's loader Job as observed (after creating it); None for a model that is not
        downloaded, or when the objects could not be read or written (then a problem in `work`)."""
        if not spec.source.is_downloaded:
            return None
        meta = model["metadata"]
        ns, key = meta["namespace"], spec.source.fetch_key
        try:
            self._ensure_access(model)
        except ApiException as e:
            work.problems.append(problem_of("LoaderAccess", e))  # its ServiceAccount, Role, RoleBinding
            return None
        try:
            jobs = self.kube.list("Job", ns, f"{FETCH_LABEL}={meta['name']}")
            current = next((j for j in jobs if j["metadata"]["labels"].get(CACHE_KEY_LABEL) == key), None)
            if current is None:
                self._create(model, spec, key)
                return observe_loader(None, [], key, PROGRESS_ANNOTATION)
            uid, state = self._cached.get((ns, meta["name"]), ("", None))
            if state is None or uid != current["metadata"].get("uid"):
                pods = self.kube.list("Pod", ns, f"{FETCH_LABEL}={meta['name']},{CACHE_KEY_LABEL}={key}")
                state = observe_loader(current, pods, key, PROGRESS_ANNOTATION)
            if state.is_ready:
                self._cached[(ns, meta["name"])] = (current["metadata"].get("uid"), state)
                for job in jobs:
                    if job is not current:
                        self.kube.delete("Job", job["metadata"]["name"], ns)
            elif state.is_failed:
                self.events.post(model, "Warning", "DownloadFailed", state.message)
            else:
                work.later(PROGRESS_SECONDS)
            return state
        except ApiException as e:
            work.problems.append(problem_of("Job", e))
            return None

    def forget(self, key: tuple[str, str]) -> None:
        self._has_access = {a for a in self._has_access if a[0] != key[0]}
        self._cached.pop(key, None)

    def _ensure_access(self, model: dict) -> None:
        stamp = (model["metadata"]["namespace"], model["metadata"]["uid"])
        if stamp in self._has_access:
            return
        for body in build_loader_access(model):
            self.kube.create_unless_exists(body)
        self._has_access.add(stamp)

    def _create(self, model: dict, spec: ModelSpec, key: str) -> None:
        body = build_loader_job(model, spec, self.settings, key)
        if not self.kube.create_unless_exists(body):
            return  # the previous Job of this key is still being removed; the next pass looks again
        self.events.post(
            model,
            "Normal",
            "LoaderJobCreated",
            f"loader Job {body['metadata']['name']} downloads {spec.source.uri} into the model cache "
            f"(key {key})",
        )


# ---- the builders ------------------------------------------------------------------------------


PERMANENT_EXIT = 2  # the loader's exit code for what retrying cannot fix
# where the loader finds spec.model.caBundle's certificates, and the variables its clients read them from
# (requests: REQUESTS_CA_BUNDLE; botocore: AWS_CA_BUNDLE; httpx, which huggingface_hub uses: SSL_CERT_FILE)
CA_DIR = "/etc/spyre-serve/ca"
CA_FILE = f"{CA_DIR}/ca.crt"
CA_ENV = ("REQUESTS_CA_BUNDLE", "AWS_CA_BUNDLE", "SSL_CERT_FILE")
# what of spec.env the loader gets: its way out (a proxy), whom it trusts, and the files it fetches beside
# what the runtime reads (SPYRE_FETCH_INCLUDE: globs of an hf:// repository)
NETWORK_ENV = (
    "SPYRE_FETCH_INCLUDE",
    "HTTPS_PROXY",
    "HTTP_PROXY",
    "NO_PROXY",
    "https_proxy",
    "http_proxy",
    "no_proxy",
    *CA_ENV,
)


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
    """Its own pod's name and namespace (for the progress annotation), the credentials of
    spec.model.secretRef key by key, the CA bundle of spec.model.caBundle, and spec.env's proxy and CA
    settings (which win over the CA bundle's paths)."""
    env = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    if spec.source.secret_ref:
        for key, required in spec.source.secret_keys:
            ref = {"name": spec.source.secret_ref, "key": key, **({} if required else {"optional": True})}
            env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    user = {v["name"]: v for v in spec.env if v["name"] in NETWORK_ENV}
    if spec.source.ca_bundle is not None:
        env += [{"name": n, "value": CA_FILE} for n in CA_ENV if n not in user]
    return env + [dict(v) for v in user.values()]


def build_loader_job(model: dict, spec: ModelSpec, settings: OperatorSettings, key: str) -> dict:
    """The Job that fills `models/<key>` of the graph-cache claim with the model, then ends."""
    ca = spec.source.ca_bundle
    ca_items = [{"key": ca.key, "path": CA_FILE.rsplit("/", 1)[1]}] if ca else []
    name = model["metadata"]["name"]
    labels = {FETCH_LABEL: name, CACHE_KEY_LABEL: key, COMPONENT_LABEL: "model-loader", **MANAGED_BY}
    args = spec.source.loader_args(f"{CACHE_MOUNT}/{spec.source.cache_folder}")
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
            *([{"name": "ca-bundle", "mountPath": CA_DIR, "readOnly": True}] if ca else []),
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
            *([{"name": "ca-bundle", "configMap": {"name": ca.config_map, "items": ca_items}}] if ca else []),
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


# ---- what is read off the Job and its pods ------------------------------------------------------


def observe_loader(job: dict | None, pods: list[dict], key: str, progress_annotation: str) -> ModelCacheState:
    """Reads a loader Job and its pods (None: not created yet). Failed means the Job failed, or a pod
    exited with the loader's permanent code 2 (a cluster without pod failure policies would retry it)."""
    if job is None:
        return ModelCacheState(
            key, False, False, "Downloading", f"creating the loader Job for fetch key {key}"
        )
    name = job["metadata"]["name"]
    status = job.get("status") or {}
    mine = sorted(
        (p for p in pods if (p["metadata"].get("labels") or {}).get("job-name") == name),
        key=lambda p: p["metadata"].get("creationTimestamp") or "",
    )
    done, total = _progress(mine, progress_annotation)
    if status.get("succeeded"):
        size = f": {total} bytes" if total else ""
        return ModelCacheState(key, True, False, "Cached", f"loader Job {name} cached the model{size}")
    failed = {c.get("type"): c for c in status.get("conditions") or []}.get("Failed", {})
    permanent = next((w for p in mine if (w := _exit_words(p, permanent_only=True))), None)
    if failed.get("status") == "True" or permanent is not None:
        words = permanent or next((w for p in reversed(mine) if (w := _exit_words(p))), None)
        why = words or failed.get("message") or failed.get("reason") or "the loader failed"
        return ModelCacheState(
            key,
            False,
            True,
            "DownloadFailed",
            f"loader Job {name} failed: {why} (fix the cause, then delete the Job to download again; "
            f"{UNREACHABLE})",
        )
    so_far = f"{done} of {total} bytes" if total else "starting"
    for pod in mine[-1:]:
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in STUCK_REASONS:
                so_far = f"loader pod cannot start ({waiting['reason']}: {waiting.get('message', '')})"
    last = next((w for p in reversed(mine) if (w := _exit_words(p))), None)
    retrying = f"; its last attempt failed: {last}; retrying" if last else ""
    return ModelCacheState(key, False, False, "Downloading", f"{so_far} (loader Job {name}{retrying})")


def _progress(pods: list[dict], annotation: str) -> tuple[int, int]:
    """The latest pod's "<done>/<total>" bytes, as the loader writes them."""
    for pod in reversed(pods):
        value = (pod["metadata"].get("annotations") or {}).get(annotation, "")
        done, _, total = value.partition("/")
        if done.isdigit() and total.isdigit():
            return int(done), int(total)
    return 0, 0


def _exit_words(pod: dict, permanent_only: bool = False) -> str | None:
    """The last line of a failed loader container's termination message, with its exit code."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated = (cs.get("state") or {}).get("terminated") or {}
        code = terminated.get("exitCode", 0)
        if code == 0 or (permanent_only and code != 2):
            continue
        words = last_line(terminated.get("message"))
        return f"exit code {code}" + (f": {words}" if words else "")
    return None
