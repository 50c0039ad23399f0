"""Progress as JSON lines on stdout and, inside a pod, as the pod's `spyre-serve.io/model-progress`
annotation ("<done>/<total>"), which the operator reads into the ModelCached condition.

Both at most once per `interval` seconds, and once more at the end. A failing annotation patch is logged
once and never stops the download."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import TextIO

log = logging.getLogger("spyre_runtime.sources")

PROGRESS_ANNOTATION = "spyre-serve.io/model-progress"


class PodAnnotator:
    """Patches one pod's progress annotation. `from_env()` is None outside a pod (no POD_NAME and
    POD_NAMESPACE) or without a Kubernetes client config (KUBECONFIG, else in-cluster)."""

    def __init__(self, api, name: str, namespace: str) -> None:
        self.api = api
        self.name = name
        self.namespace = namespace
        self._warned = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> PodAnnotator | None:
        name, namespace = env.get("POD_NAME"), env.get("POD_NAMESPACE")
        if not name or not namespace:
            return None
        try:
            from kubernetes import client, config

            if env.get("KUBECONFIG"):
                api_client = config.new_client_from_config(config_file=env["KUBECONFIG"])
            else:
                configuration = client.Configuration()
                config.load_incluster_config(client_configuration=configuration)
                api_client = client.ApiClient(configuration)
        except Exception as e:  # no config, unreadable config, kubernetes not installed
            log.warning("progress annotation off: no Kubernetes client config (%s)", e)
            return None
        return cls(client.CoreV1Api(api_client), name, namespace)

    def patch(self, done: int, total: int) -> None:
        body = {"metadata": {"annotations": {PROGRESS_ANNOTATION: f"{done}/{total}"}}}
        try:
            self.api.patch_namespaced_pod(self.name, self.namespace, body, _request_timeout=5)
        except Exception as e:
            if not self._warned:
                log.warning("cannot annotate pod %s/%s with progress: %s", self.namespace, self.name, e)
                self._warned = True


class Progress:
    """Bytes done of the total, reported on a cadence. `done` counts bytes on disk, so a resumed run
    starts where the last one stopped and a deleted (mismatching) file takes its bytes back."""

    def __init__(
        self,
        total: int,
        done: int = 0,
        *,
        out: TextIO | None = None,
        pod: PodAnnotator | None = None,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.done = done
        self.downloaded = 0  # bytes this run transferred
        self.out = out or sys.stdout
        self.pod = pod
        self.interval = interval
        self.clock = clock
        self._last = float("-inf")
        self.report()

    def advance(self, num_bytes: int) -> None:
        self.done += num_bytes
        self.downloaded += num_bytes
        if self.clock() - self._last >= self.interval:
            self.report()

    def rewind(self, num_bytes: int) -> None:
        self.done -= num_bytes

    def report(self) -> None:
        self._last = self.clock()
        self.emit({"event": "progress", "done": self.done, "total": self.total})
        if self.pod is not None:
            self.pod.patch(self.done, self.total)

    def emit(self, event: dict) -> None:
        self.out.write(json.dumps(event) + "\n")
        self.out.flush()
