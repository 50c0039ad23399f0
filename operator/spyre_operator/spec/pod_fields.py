"""The SpyreModel fields passed on to its pods (image, resources, env, placement, the card resource and
devices), checked by the rules Kubernetes and the kubelet apply to them, so that a pod the API server would
refuse, or one that would never start, is refused as InvalidSpec before it exists. The CRD states the same
rules in CEL for clusters that enforce it (1.25 and later)."""

from __future__ import annotations

import re

from spyre_contract.image_reference import image_reference_error
from spyre_contract.tracing import endpoint_error, traces_url

from spyre_operator.spec.model_spec import Devices, InvalidSpec, quantity_bytes

# Kubernetes' resource.Quantity syntax: a number and a binary-SI, decimal-SI or exponent suffix
K8S_QUANTITY = re.compile(
    r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?$"
)
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
DNS_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
RESOURCE_NAME = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
ATTRIBUTE_NAME = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[A-Za-z0-9]([-A-Za-z0-9_]*[A-Za-z0-9])?$"
)
# the card resources IBM's device plugins publish (ibm.com/spyre_pf, spyre_vf, spyre_pf_tier0, aiu_pf)
CARD_RESOURCE = re.compile(r"^ibm\.com/(spyre|aiu)_")
VF_CLASS = "spyre-standard-vf"  # IBM's DRA driver: spyre-pf, spyre-standard-vf, spyre-privileged-vf
DEVICES_AND_CARD_RESOURCE = (
    "spec.devices.deviceClassName and spec.cardResource exclude each other (with spec.devices, cardResource "
    "only picks the DeviceClass: ibm.com/spyre_vf is spyre-standard-vf, whole cards spyre-pf)"
)


def parse_pod_fields(spec: dict) -> dict:
    """The ModelSpec fields a pod carries as they are, Kubernetes' own rules checked."""
    card_resource = _card_resource(spec.get("cardResource"))
    devices = _devices(spec.get("devices"), card_resource)
    return {
        "image": _image(spec.get("image")),
        "card_resource": card_resource,
        "devices": devices,
        "resources": _resources(spec.get("resources")),
        "env": _env(spec.get("env")),
        "node_selector": _node_selector(spec.get("nodeSelector")),
        "tolerations": _tolerations(spec.get("tolerations")),
        "affinity": object_field(spec, "affinity") or None,
        "scheduler_name": _dns_name(spec, "schedulerName"),
        "priority_class_name": _dns_name(spec, "priorityClassName"),
        "tracing_endpoint": _tracing_endpoint(object_field(spec, "tracing")),
        "network_peers": _network_peers(object_field(spec, "networkPolicy").get("from")),
        "kv_events_port": _kv_events_port(spec.get("kvEvents")),
    }


def _tracing_endpoint(tracing: dict) -> str | None:
    """spec.tracing.otlpEndpoint: where the pods send one span per request (OTLP/HTTP)."""
    url = tracing.get("otlpEndpoint")
    if url is None:
        return None
    if error := endpoint_error(url):
        raise InvalidSpec("tracing.otlpEndpoint", error)
    return traces_url(url)


def object_field(spec: dict, key: str) -> dict:
    value = spec.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidSpec(key, f"must be an object, got {value!r}")
    return value


def string_field(spec: dict, key: str) -> str | None:
    value = spec.get(key)
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise InvalidSpec(key, f"must be a non-empty string, got {value!r}")
    return value


def int_field(path: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSpec(path, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise InvalidSpec(path, f"must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidSpec(path, f"must be at most {maximum}, got {value}")
    return value


def card_counts(resources: dict, card_resource: str) -> list[tuple[str, object]]:
    """(field path, amount) of every card count in requests and limits: the pod's card resource, or any
    resource IBM's device plugins publish cards under."""
    return [
        (f"resources.{part}.{name}", amount)
        for part in ("requests", "limits")
        for name, amount in (resources.get(part) or {}).items()
        if name == card_resource or CARD_RESOURCE.match(name)
    ]


def check_card_counts(resources: dict, card_resource: str, cards: int, by_devices: bool) -> None:
    """A card count in requests or limits must say what spec.cards says (and none may be there when the
    cards come by DRA): the operator sets the pod's card resource from spec.cards."""
    for path, amount in card_counts(resources, card_resource):
        if by_devices:
            raise InvalidSpec(
                path,
                "asks for cards by extended resource while spec.devices asks for them by Dynamic Resource "
                "Allocation: leave it out",
            )
        if _count(amount) != cards:
            raise InvalidSpec(
                path,
                f"asks for {amount} cards but spec.cards is {cards} (the operator sets it from spec.cards)",
            )


def _count(amount) -> float | None:
    try:
        return quantity_bytes(str(amount))
    except ValueError:  # 500m: not a whole number of cards
        return None


# ---- fields --------------------------------------------------------------------------------------


def _image(value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidSpec("image", f"must be an image reference, got {value!r}")
    if error := image_reference_error(value):
        raise InvalidSpec("image", f"{error} (a pod with it never starts: InvalidImageName)")
    return value


def _card_resource(value) -> str | None:
    if value is not None and (not isinstance(value, str) or not RESOURCE_NAME.match(value)):
        raise InvalidSpec(
            "cardResource",
            f"{value!r} is not an extended resource name like ibm.com/spyre_pf or ibm.com/spyre_vf",
        )
    return value


def device_class_for(card_resource: str | None) -> str:
    """The DeviceClass IBM's DRA driver publishes for the kind of card a resource names: virtual functions
    (ibm.com/spyre_vf) are spyre-standard-vf, whole cards (spyre_pf, its tiers, aiu_pf) spyre-pf."""
    if card_resource and card_resource.startswith("ibm.com/spyre_vf"):
        return VF_CLASS
    return Devices.device_class


def _devices(value, card_resource: str | None) -> Devices | None:
    """spec.devices; with no deviceClassName, the class of spec.cardResource's kind of card
    (device_class_for); a class named beside a cardResource is refused (they would say different things)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidSpec("devices", f"must be an object, got {value!r}")
    if card_resource is not None and "deviceClassName" in value:
        raise InvalidSpec("", DEVICES_AND_CARD_RESOURCE)
    device_class = value.get("deviceClassName", device_class_for(card_resource))
    if not isinstance(device_class, str) or not DNS_NAME.match(device_class):
        raise InvalidSpec("devices.deviceClassName", f"must be a DNS name, got {device_class!r}")
    attribute = value.get("matchAttribute", Devices.match_attribute)
    if not isinstance(attribute, str) or not ATTRIBUTE_NAME.match(attribute):
        raise InvalidSpec(
            "devices.matchAttribute",
            f"must be a qualified attribute name like spyre.ibm.com/numaInfo, got {attribute!r}",
        )
    return Devices(device_class, attribute)


def _dns_name(spec: dict, key: str) -> str | None:
    value = string_field(spec, key)
    if value is not None and (len(value) > 253 or not DNS_NAME.match(value)):
        raise InvalidSpec(key, f"must be a DNS name (lower-case letters, digits, '-' and '.'), got {value!r}")
    return value


def _resources(value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidSpec("resources", f"must be an object with requests and limits, got {value!r}")
    for part, amounts in value.items():
        if part not in ("requests", "limits"):
            raise InvalidSpec(
                f"resources.{part}", "is not supported (use requests and limits; cards by DRA: spec.devices)"
            )
        if not isinstance(amounts, dict):
            raise InvalidSpec(f"resources.{part}", f"must map resource names to quantities, got {amounts!r}")
        for resource, amount in amounts.items():
            if isinstance(amount, bool) or not (
                isinstance(amount, int | float) or (isinstance(amount, str) and K8S_QUANTITY.match(amount))
            ):
                raise InvalidSpec(
                    f"resources.{part}.{resource}", f"must be a quantity like 4, 500m or 16Gi, got {amount!r}"
                )
    return value


def _env(value) -> tuple:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidSpec("env", f"must be a list of {{name, value}} objects, got {value!r}")
    seen = set()
    for i, var in enumerate(value):
        if not isinstance(var, dict) or not var.get("name"):
            raise InvalidSpec(f"env[{i}]", "must be an object with a name")
        name = var["name"]
        if not isinstance(name, str) or not ENV_NAME.match(name):
            raise InvalidSpec(f"env[{i}].name", f"{name!r} is not a valid environment variable name")
        if name in seen:
            raise InvalidSpec(f"env[{i}].name", f"{name} is set twice")
        seen.add(name)
        if "value" in var and "valueFrom" in var:
            raise InvalidSpec(f"env[{i}]", f"{name}: value and valueFrom exclude each other")
        if "value" in var and not isinstance(var["value"], str):
            raise InvalidSpec(
                f"env[{i}].value", f"{name}: must be a string (quote it in YAML), got {var['value']!r}"
            )
        if "valueFrom" in var and not isinstance(var["valueFrom"], dict):
            raise InvalidSpec(f"env[{i}].valueFrom", f"{name}: must be an object")
        unknown = set(var) - {"name", "value", "valueFrom"}
        if unknown:
            raise InvalidSpec(f"env[{i}]", f"{name}: unknown fields {sorted(unknown)}")
    return tuple(value)


def _label_key_ok(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    return (
        0 < len(name) <= 63
        and bool(LABEL_NAME.match(name))
        and (not prefix or (len(prefix) <= 253 and bool(DNS_NAME.match(prefix))))
    )


def _node_selector(value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidSpec("nodeSelector", f"must map label keys to values, got {value!r}")
    for key, label in value.items():
        if not isinstance(key, str) or not _label_key_ok(key):
            raise InvalidSpec("nodeSelector", f"{key!r} is not a valid label key")
        if not isinstance(label, str) or len(label) > 63 or not LABEL_NAME.match(label):
            raise InvalidSpec(f"nodeSelector.{key}", f"{label!r} is not a valid label value")
    return value


def _tolerations(value) -> tuple:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidSpec("tolerations", f"must be a list, got {value!r}")
    for i, t in enumerate(value):
        if not isinstance(t, dict):
            raise InvalidSpec(f"tolerations[{i}]", f"must be an object, got {t!r}")
        op = t.get("operator", "Equal")
        if op not in ("Equal", "Exists"):
            raise InvalidSpec(f"tolerations[{i}].operator", f"must be Equal or Exists, got {op!r}")
        if op == "Exists" and t.get("value"):
            raise InvalidSpec(f"tolerations[{i}].value", "must be empty when operator is 'Exists'")
        if t.get("effect") not in (None, "", "NoSchedule", "PreferNoSchedule", "NoExecute"):
            raise InvalidSpec(f"tolerations[{i}].effect", f"is not a taint effect: {t.get('effect')!r}")
    return tuple(value)


PEER_KEYS = ("podSelector", "namespaceSelector", "ipBlock")


def _network_peers(value) -> tuple:
    """spec.networkPolicy.from: NetworkPolicyPeers, passed on to the model's NetworkPolicy as they are (the
    API server checks their selectors when the operator writes the policy)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidSpec("networkPolicy.from", f"must be a list of NetworkPolicyPeers, got {value!r}")
    for i, peer in enumerate(value):
        at = f"networkPolicy.from[{i}]"
        if not isinstance(peer, dict) or not peer or set(peer) - set(PEER_KEYS):
            raise InvalidSpec(at, f"must be an object of {', '.join(PEER_KEYS)}, got {peer!r}")
        if "ipBlock" in peer and len(peer) > 1:
            raise InvalidSpec(at, "ipBlock excludes podSelector and namespaceSelector")
        for key, part in peer.items():
            if not isinstance(part, dict) or (key == "ipBlock" and not isinstance(part.get("cidr"), str)):
                raise InvalidSpec(f"{at}.{key}", f"must be an object{' with a cidr' * (key == 'ipBlock')}")
    return tuple(dict(p) for p in value)


DEFAULT_KV_EVENTS_PORT = 5557  # vLLM's default endpoint, tcp://*:5557


def _kv_events_port(value) -> int | None:
    """spec.kvEvents: present means the runtime publishes its prefix cache's KV events (vLLM's ZeroMQ format)
    on this port of the pod, for subscribers such as llm-d's KV-cache-aware router."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"port"}:
        raise InvalidSpec("kvEvents", f"must be an object with an optional port, got {value!r}")
    port = value.get("port", DEFAULT_KV_EVENTS_PORT)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise InvalidSpec("kvEvents.port", f"must be a port number (1-65535), got {port!r}")
    return port
