"""Kubernetes Events about SpyreModels, posted from any thread (the reconcile workers have no kopf context),
at most once per distinct (object, type, reason, message)."""

from __future__ import annotations

import datetime
import logging
import threading

from kubernetes import client
from kubernetes.client.rest import ApiException

from spyre_operator.settings import GROUP, KIND, VERSION

log = logging.getLogger(__name__)


class EventRecorder:
    """Posts core/v1 Events from any thread (no kopf context needed), at most once per distinct
    (object, type, reason, message)."""

    def __init__(self, core: client.CoreV1Api, timeout: float) -> None:
        self.core = core
        self.timeout = timeout
        self._seen: dict[tuple, None] = {}
        self._lock = threading.Lock()

    def post(self, model: dict, type_: str, reason: str, message: str, once: bool = True) -> None:
        meta = model["metadata"]
        fingerprint = (meta["uid"], type_, reason, message)
        with self._lock:
            if once and fingerprint in self._seen:
                return
            self._seen[fingerprint] = None
            while len(self._seen) > 20000:
                self._seen.pop(next(iter(self._seen)))
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": KIND,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": "spyre-operator"},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.core.create_namespaced_event(
                meta["namespace"], body, _request_timeout=self.timeout, _preload_content=False
            )
        except (ApiException, OSError) as e:  # an Event is best effort; the status holds the truth
            with self._lock:  # not posted: the same words may be posted again
                self._seen.pop(fingerprint, None)
            log.warning("could not post event %s for %s/%s: %s", reason, meta["namespace"], meta["name"], e)
