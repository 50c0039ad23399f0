"""The operator's one door to the API server: create, read, list, patch and delete of the objects it owns
(Pod, Service, PersistentVolumeClaim, Job, ResourceClaimTemplate, InferencePool, NetworkPolicy, PodMonitor,
the model loader's ServiceAccount, Role and RoleBinding, the token-authorized model's ServiceAccount and
ClusterRoleBinding), the Secrets its pods read, the nodes it may read, which APIs the cluster serves, the
SpyreModel and its status. Every call carries the settings' timeout and answers plain dicts; a 404 on a read
or a delete is an answer (None; nothing left to delete), not an error. And how a refused or failed call
reaches the status: as a Problem with the API server's own message."""

from __future__ import annotations

import json

from kubernetes import client
from kubernetes.client.rest import ApiException

from spyre_operator.io.work import Problem
from spyre_operator.settings import (
    GROUP,
    MONITOR_GROUP,
    MONITOR_PLURAL,
    MONITOR_VERSION,
    PLURAL,
    POOL_GROUP,
    POOL_PLURAL,
    POOL_VERSION,
    VERSION,
)

# the kinds the operator owns, as the client's method names spell them
_METHOD_NAMES = {
    "Pod": "pod",
    "Service": "service",
    "PersistentVolumeClaim": "persistent_volume_claim",
    "Job": "job",
    "ResourceClaimTemplate": "resource_claim_template",
    "ServiceAccount": "service_account",
    "Role": "role",
    "RoleBinding": "role_binding",
    "NetworkPolicy": "network_policy",
    "Secret": "secret",  # read only: the Secrets a model's pods read (spec.auth, spec.tls)
}
# the custom resources the operator owns: (group, version, plural)
_CUSTOM_KINDS = {
    "InferencePool": (POOL_GROUP, POOL_VERSION, POOL_PLURAL),
    "PodMonitor": (MONITOR_GROUP, MONITOR_VERSION, MONITOR_PLURAL),
}


class Kube:
    def __init__(self, api_client: client.ApiClient, timeout: float) -> None:
        self.core = client.CoreV1Api(api_client)
        self.batch = client.BatchV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.resource = client.ResourceV1Api(api_client)
        self.rbac = client.RbacAuthorizationV1Api(api_client)
        self.networking = client.NetworkingV1Api(api_client)
        self.timeout = timeout

    def _method(self, verb: str, kind: str):
        if kind in _CUSTOM_KINDS:
            return self._custom_method(verb, *_CUSTOM_KINDS[kind])
        api = {"Job": self.batch, "ResourceClaimTemplate": self.resource, "Role": self.rbac}.get(
            kind, self.core
        )
        api = self.rbac if kind == "RoleBinding" else self.networking if kind == "NetworkPolicy" else api
        return getattr(api, f"{verb}_namespaced_{_METHOD_NAMES[kind]}")

    def _custom_method(self, verb: str, group: str, version: str, plural: str):
        """A custom resource's method, called as the built-in kinds' are: (namespace, body) to create and
        list, (name, namespace, ...) otherwise; a list as a patch is a JSON patch."""
        method = getattr(self.custom, f"{'get' if verb == 'read' else verb}_namespaced_custom_object")
        if verb in ("create", "list"):
            return lambda namespace, *rest, **kw: method(group, version, namespace, plural, *rest, **kw)

        def call(name, namespace, *rest, **kw):
            if rest and isinstance(rest[0], list):
                kw["_content_type"] = "application/json-patch+json"
            return method(group, version, namespace, plural, name, *rest, **kw)

        return call

    # ---- owned objects -----------------------------------------------------------------------------

    def create(self, body: dict, dry_run: bool = False) -> dict:
        """Creates `body` (its kind and namespace read off it); the object as the API server stored it.
        `dry_run`: admission and validation only, nothing stored."""
        extra = {"dry_run": "All"} if dry_run else {}
        if body["kind"] == "ClusterRoleBinding":  # the one cluster-scoped kind (spec.auth.kubernetes)
            resp = self.rbac.create_cluster_role_binding(
                body, _request_timeout=self.timeout, _preload_content=False, **extra
            )
            return json.loads(resp.data)
        resp = self._method("create", body["kind"])(
            body["metadata"]["namespace"],
            body,
            _request_timeout=self.timeout,
            _preload_content=False,
            **extra,
        )
        return json.loads(resp.data)

    def create_unless_exists(self, body: dict) -> bool:
        """Creates `body`; False when an object of its name exists already."""
        try:
            self.create(body)
        except ApiException as e:
            if e.status == 409:
                return False
            raise
        return True

    def read(self, kind: str, name: str, namespace: str) -> dict | None:
        try:
            resp = self._method("read", kind)(
                name, namespace, _preload_content=False, _request_timeout=self.timeout
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return json.loads(resp.data)

    def list(self, kind: str, namespace: str, selector: str) -> list[dict]:
        return self.listing(kind, namespace, selector)[0]

    def listing(self, kind: str, namespace: str, selector: str) -> tuple[list[dict], str]:
        """The objects and the list's resourceVersion (what the API server's answer is as of)."""
        resp = self._method("list", kind)(
            namespace, label_selector=selector, _preload_content=False, _request_timeout=self.timeout
        )
        answer = json.loads(resp.data)
        return answer["items"], (answer.get("metadata") or {}).get("resourceVersion", "")

    def patch(self, kind: str, name: str, namespace: str, patch: dict) -> None:
        self._method("patch", kind)(
            name, namespace, patch, _preload_content=False, _request_timeout=self.timeout
        )

    def delete(self, kind: str, name: str, namespace: str) -> None:
        """Deletes the object (a Job with its pods, in the background); one already gone is no error."""
        extra = {"propagation_policy": "Background"} if kind == "Job" else {}
        try:
            self._method("delete", kind)(
                name, namespace, _preload_content=False, _request_timeout=self.timeout, **extra
            )
        except ApiException as e:
            if e.status != 404:
                raise

    # ---- what the cluster serves --------------------------------------------------------------------

    def serves(self, group: str, version: str, plural: str) -> bool:
        """Whether the API server serves `plural` in group/version (its discovery document); a 404 is a no
        (the CRD is not installed)."""
        try:
            resp = self.custom.get_api_resources(
                group, version, _preload_content=False, _request_timeout=self.timeout
            )
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        return any(r.get("name") == plural for r in json.loads(resp.data).get("resources") or [])

    def serves_claim_templates(self) -> bool:
        """Whether the API server serves ResourceClaimTemplates in resource.k8s.io/v1 (DRA, Kubernetes 1.34
        and later): its discovery document; a 404 is a no."""
        try:
            resp = self.resource.get_api_resources(_preload_content=False, _request_timeout=self.timeout)
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        resources = json.loads(resp.data).get("resources") or []
        return any(r.get("name") == "resourceclaimtemplates" for r in resources)

    # ---- nodes -------------------------------------------------------------------------------------

    def read_node(self, name: str) -> dict:
        resp = self.core.read_node(name, _preload_content=False, _request_timeout=self.timeout)
        return json.loads(resp.data)

    def pods_on_node(self, node: str) -> list[dict]:
        resp = self.core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={node}", _preload_content=False, _request_timeout=self.timeout
        )
        return json.loads(resp.data)["items"]

    # ---- the SpyreModel ----------------------------------------------------------------------------

    def get_model(self, namespace: str, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, _request_timeout=self.timeout
        )

    def replace_model_status(self, body: dict) -> None:
        meta = body["metadata"]
        self.custom.replace_namespaced_custom_object_status(
            GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], body, _request_timeout=self.timeout
        )


def api_message(e: ApiException) -> str:
    """The API server's own message (its Status body), else the HTTP reason."""
    try:
        body = json.loads(e.body or "")
        if isinstance(body, dict) and body.get("message"):
            return str(body["message"])
    except (TypeError, ValueError):
        pass
    return f"{e.status} {e.reason}".strip()


def is_quota(e: ApiException) -> bool:
    return e.status == 403 and "exceeded quota" in api_message(e)


def problem_of(kind: str, e: Exception) -> Problem:
    """A failed action on an object of `kind`: refused (4xx, needs a human: Stalled) or failed (5xx,
    timeouts: retried)."""
    if isinstance(e, ApiException):
        if is_quota(e):
            # from "exceeded quota" on: the refused object's name (a pod's is new each try) would make each
            # refusal new words, a new status and a new Event
            message = api_message(e)
            message = message[message.index("exceeded quota") :]
            return Problem("QuotaExceeded", f"{kind} refused: {message}", is_stalled=False)
        if e.status and 400 <= e.status < 500 and e.status not in (408, 409, 429):
            return Problem(f"{kind}Rejected", api_message(e))
        return Problem("APIError", f"{kind}: {api_message(e)}", is_stalled=False)
    return Problem("APIError", f"{kind}: {type(e).__name__}: {e}", is_stalled=False)
