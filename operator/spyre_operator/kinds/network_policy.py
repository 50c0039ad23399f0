"""Who may reach the model's pods: a NetworkPolicy per model, when the operator's setting asks for one
(chart value networkPolicy.enabled). It selects the model's serving pods and admits, on the runtime's port
(the OpenAI API; /health and /metrics share it), the pods of the model's own namespace and the peers
spec.networkPolicy.from names, and the monitoring namespace's scrapers (chart value
networkPolicy.monitoringNamespace); on the KV-events port (spec.kvEvents, only when the spec enables it), the
same peers as the API. Ingress only: what the pods reach is left alone. The model's namespace is the
policy's own (an empty podSelector); the monitoring namespace is named by the label the API server puts on
each namespace (kubernetes.io/metadata.name, Kubernetes 1.21 and later).

The step: the policy is made once per generation; what the operator owns of it (its spec) restored when
someone changed it; removed when the setting is off (the watch lists the policies at start-up, so a model's
policy left from when it was on is known without a request per model). A policy of the model's name that the
model does not own is for a human to settle. A policy is enforced only where the cluster's network plugin
enforces NetworkPolicies (docs/security.md names them)."""

from __future__ import annotations

from kubernetes.client.rest import ApiException

from spyre_operator.io.events import EventRecorder
from spyre_operator.io.kube import Kube, problem_of
from spyre_operator.io.watch import Key, WatchCache
from spyre_operator.io.work import Pass, Problem
from spyre_operator.kinds.ownership import is_owned_by, owner_reference, selector_labels
from spyre_operator.settings import MANAGED_BY, MODEL_LABEL, OperatorSettings
from spyre_operator.spec.model_spec import ModelSpec

KIND = "NetworkPolicy"
NAMESPACE_LABEL = "kubernetes.io/metadata.name"


class NetworkPolicyStep:
    def __init__(
        self, settings: OperatorSettings, kube: Kube, events: EventRecorder, cache: WatchCache
    ) -> None:
        self.settings = settings
        self.kube = kube
        self.events = events
        self.cache = cache

    def ensure(self, key: Key, model: dict, spec: ModelSpec, work: Pass) -> None:
        """Checked once per generation and again when its watch reports a change; a failure is a problem
        in `work`. Pods do not wait for it."""
        stamp = (model["metadata"]["uid"], model["metadata"].get("generation"))
        if self.cache.owned_stamp(key, KIND) == stamp:
            return
        want = build_network_policy(model, spec, self.settings)
        try:
            if want is not None:
                is_settled = self._apply(model, want, work)
            else:
                is_settled = not self.cache.has_policy(key) or self._remove(model)
        except ApiException as e:
            work.problems.append(problem_of(KIND, e))
            return
        if is_settled:
            self.cache.set_owned_stamp(key, KIND, stamp)

    def _apply(self, model: dict, want: dict, work: Pass) -> bool:
        name, namespace = want["metadata"]["name"], want["metadata"]["namespace"]
        if self.kube.create_unless_exists(want):
            self.events.post(model, "Normal", "NetworkPolicyCreated", describe(want))
            return True
        have = self.kube.read(KIND, name, namespace)
        if have is None:  # removed meanwhile: the next pass makes it
            raise ApiException(status=409, reason="NetworkPolicy was being removed")
        if not is_owned_by(have, model):
            message = (
                f"NetworkPolicy {name} exists and is not owned by this SpyreModel: rename the model or "
                "remove the NetworkPolicy"
            )
            work.problems.append(Problem("NetworkPolicyConflict", message))
            return False
        if _pruned(have.get("spec")) != _pruned(want["spec"]):
            patch = [{"op": "replace", "path": "/spec", "value": want["spec"]}]
            self.kube.patch(KIND, name, namespace, patch)
            self.events.post(model, "Normal", "NetworkPolicyUpdated", describe(want), once=False)
        return True

    def _remove(self, model: dict) -> bool:
        """The model's own policy goes when the setting is off (a policy it does not own stays)."""
        name, namespace = model["metadata"]["name"], model["metadata"]["namespace"]
        have = self.kube.read(KIND, name, namespace)
        if have is not None and is_owned_by(have, model):
            self.kube.delete(KIND, name, namespace)
            message = f"NetworkPolicy {name}: the operator's network policy setting is off"
            self.events.post(model, "Normal", "NetworkPolicyDeleted", message)
        return True


# ---- the builder ---------------------------------------------------------------------------------


def namespace_peer(namespace: str) -> dict:
    """Every pod of one namespace, by the label the API server gives each namespace its name in."""
    return {"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: namespace}}}


def build_network_policy(model: dict, spec: ModelSpec, settings: OperatorSettings) -> dict | None:
    """The model's NetworkPolicy, named after the model and owned by it; None when the setting is off."""
    if not settings.network_policy:
        return None
    name, namespace = model["metadata"]["name"], model["metadata"]["namespace"]
    peers = [{"podSelector": {}}, *(dict(p) for p in spec.network_peers)]  # {}: the policy's namespace
    ingress = [{"from": peers, "ports": [_tcp(settings.runtime_port)]}]  # the API (and /health, /metrics)
    monitoring = settings.monitoring_namespace
    if monitoring and monitoring != namespace:  # the scrapers: the metrics share the API's port
        ingress.append({"from": [namespace_peer(monitoring)], "ports": [_tcp(settings.runtime_port)]})
    if spec.kv_events_port is not None:
        ingress.append({"from": peers, "ports": [_tcp(spec.kv_events_port)]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": KIND,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {MODEL_LABEL: name, **MANAGED_BY},
            "ownerReferences": [owner_reference(model)],
        },
        "spec": {
            "podSelector": {"matchLabels": selector_labels(name)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def _tcp(port: int) -> dict:
    return {"protocol": "TCP", "port": port}


def _pruned(value):
    """`value` without empty fields: what the API server drops from a stored object (an empty matchLabels,
    an empty list) does not count as a change."""
    if isinstance(value, dict):
        pruned = {k: _pruned(v) for k, v in value.items()}
        return {k: v for k, v in pruned.items() if v not in ({}, [], None)}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value


def describe(policy: dict) -> str:
    """One line for the Event: which pods, and who may reach which port."""
    spec = policy["spec"]
    labels = ",".join(f"{k}={v}" for k, v in spec["podSelector"]["matchLabels"].items())
    rules = "; ".join(
        f"port {rule['ports'][0]['port']} from {len(rule['from'])} peer(s)" for rule in spec["ingress"]
    )
    return f"NetworkPolicy {policy['metadata']['name']} admits to the pods {labels}: {rules}"
