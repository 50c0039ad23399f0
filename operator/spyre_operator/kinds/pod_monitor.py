"""What Prometheus scrapes: the model's PodMonitor (prometheus-operator, monitoring.coreos.com/v1), selecting
exactly the model's serving pods (never its compile or loader Jobs') on the runtime's port (named http),
path /metrics: vLLM's vllm:* and sendnn:* metrics, labelled model_name. Made when the cluster serves the
PodMonitor API and the operator's setting allows (SPYRE_OPERATOR_POD_MONITORS, default on; the chart turns it
off when its own chart-level monitor, metrics.podMonitor, scrapes every model).

The step: whether the API is served is asked at start-up (said in the operator's log: present or absent);
absent is no error and no condition (the model serves as before), and is asked again only when a model
changes (at most once per resync period), so a steady pass asks the API server nothing. Once
prometheus-operator's CRDs are installed, a model gets its monitor at its next change, and every model at the
operator's next start. The monitor is made once per model generation; what the operator owns of it
(selector, endpoints), drifted, is restored then.
A PodMonitor of the model's name that the model does not own is left alone (one Event says so)."""

from __future__ import annotations

import logging
import time

from kubernetes.client.rest import ApiException

from spyre_operator.io.events import EventRecorder
from spyre_operator.io.kube import Kube, problem_of
from spyre_operator.io.work import Pass
from spyre_operator.kinds.ownership import is_owned_by, owner_reference, selector_labels
from spyre_operator.settings import (
    COMPONENT_LABEL,
    MANAGED_BY,
    MODEL_LABEL,
    MONITOR_GROUP,
    MONITOR_PLURAL,
    MONITOR_VERSION,
    OperatorSettings,
)

log = logging.getLogger(__name__)
KIND = "PodMonitor"
OWNED_FIELDS = ("selector", "podMetricsEndpoints")
API = f"{MONITOR_GROUP}/{MONITOR_VERSION}"


def api_line(served: bool) -> str:
    if served:
        return (
            f"prometheus-operator's PodMonitor API ({API}) is served: a PodMonitor per model scrapes its pods"
        )
    return (
        f"prometheus-operator's PodMonitor API ({API}) is not served: no PodMonitor per model (asked again "
        "when a model changes; or scrape with the chart's metrics.podMonitor)"
    )


class PodMonitorStep:
    def __init__(self, settings: OperatorSettings, kube: Kube, events: EventRecorder) -> None:
        self.settings = settings
        self.kube = kube
        self.events = events
        self.served: bool | None = None  # the last answer; None: not asked yet
        self._asked = 0.0  # (monotonic) when

    def detect(self) -> bool:
        """Asks the API server whether it serves PodMonitors; the answer goes to the log when it is new."""
        try:
            served = self.kube.serves(MONITOR_GROUP, MONITOR_VERSION, MONITOR_PLURAL)
        except ApiException as e:
            log.warning(
                "could not ask whether %s PodMonitors are served: %s", API, problem_of(KIND, e).message
            )
            served = False
        self._asked = time.monotonic()
        if served != self.served:
            log.info(api_line(served))
        self.served = served
        return served

    def ensure(self, model: dict, work: Pass) -> bool:
        """True when settled for the model's generation: its monitor as built, or none wanted, or the API not
        served (asked again at a model's change once the resync period has passed); False on a problem."""
        if not self.settings.pod_monitors:
            return True
        if not self.served and (self.served is None or time.monotonic() - self._asked >= self._period()):
            self.detect()
        if not self.served:
            return True
        want = build_pod_monitor(model, self.settings)
        try:
            self._apply(model, want)
        except ApiException as e:
            if e.status == 404:  # the CRD went away meanwhile
                self.detect()
                return True
            work.problems.append(problem_of(KIND, e))
            return False
        return True

    def _period(self) -> float:
        return self.settings.resync_seconds

    def _apply(self, model: dict, want: dict) -> None:
        name, namespace = want["metadata"]["name"], want["metadata"]["namespace"]
        if self.kube.create_unless_exists(want):
            self.events.post(model, "Normal", "PodMonitorCreated", describe(want))
            return
        have = self.kube.read(KIND, name, namespace)
        if have is None:  # removed meanwhile: the next pass makes it
            raise ApiException(status=409, reason="PodMonitor was being removed")
        if not is_owned_by(have, model):
            message = f"PodMonitor {name} exists and is not owned by this SpyreModel: it is left as it is"
            self.events.post(model, "Warning", "PodMonitorConflict", message)
            return
        patch = monitor_repair(have, want)
        if patch:
            self.kube.patch(KIND, name, namespace, patch)
            fields = ", ".join(op["path"].rsplit("/", 1)[1] for op in patch)
            self.events.post(model, "Normal", "PodMonitorRepaired", f"PodMonitor {name}: {fields} restored")


def build_pod_monitor(model: dict, settings: OperatorSettings) -> dict:
    """The model's PodMonitor, named after the model, owned by it, labelled with the settings' monitor
    labels (those a Prometheus selects monitors by)."""
    name = model["metadata"]["name"]
    return {
        "apiVersion": API,
        "kind": KIND,
        "metadata": {
            "name": name,
            "namespace": model["metadata"]["namespace"],
            "labels": {**dict(settings.pod_monitor_labels), MODEL_LABEL: name, **MANAGED_BY},
            "ownerReferences": [owner_reference(model)],
        },
        "spec": {
            "selector": {"matchLabels": {**selector_labels(name), COMPONENT_LABEL: "inference"}},
            "podMetricsEndpoints": [
                {"port": "http", "path": "/metrics", "interval": settings.pod_monitor_interval}
            ],
        },
    }


def monitor_repair(have: dict, want: dict) -> list[dict] | None:
    """The JSON patch restoring what the operator owns of the monitor's spec; None when intact."""
    ops = [
        {"op": "add", "path": f"/spec/{field}", "value": want["spec"][field]}
        for field in OWNED_FIELDS
        if (have.get("spec") or {}).get(field) != want["spec"][field]
    ]
    return ops or None


def describe(monitor: dict) -> str:
    spec = monitor["spec"]
    labels = ",".join(f"{k}={v}" for k, v in spec["selector"]["matchLabels"].items())
    endpoint = spec["podMetricsEndpoints"][0]
    return (
        f"PodMonitor {monitor['metadata']['name']} scrapes the pods {labels} on port {endpoint['port']} "
        f"{endpoint['path']} every {endpoint['interval']}"
    )
