"""Leader election on a coordination.k8s.io/v1 Lease, as client-go's leaderelection does: a replica acts only
while it holds the Lease; it renews it every `renew_seconds`; another replica takes it over once it has not
been renewed for `lease_seconds`. A leader that cannot renew before its Lease expires stops acting at once
(the process exits and is restarted as a standby), so two replicas never reconcile at the same time."""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable

import urllib3
from kubernetes import client
from kubernetes.client.rest import ApiException

log = logging.getLogger(__name__)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _micro(t: datetime.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(text) -> datetime.datetime | None:
    if text is None:
        return None
    if isinstance(text, datetime.datetime):
        return text if text.tzinfo else text.replace(tzinfo=datetime.UTC)
    for fmt in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return datetime.datetime.strptime(text, fmt).replace(tzinfo=datetime.UTC)
        except ValueError:
            continue
    return None


class LeaderElection:
    def __init__(
        self,
        api_client: client.ApiClient,
        namespace: str,
        name: str,
        identity: str,
        lease_seconds: float = 15.0,
        renew_seconds: float = 5.0,
        retry_seconds: float = 2.0,
    ) -> None:
        self.api = client.CoordinationV1Api(api_client)
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_seconds, self.renew_seconds, self.retry_seconds = (
            lease_seconds,
            renew_seconds,
            retry_seconds,
        )
        self.is_leader = False
        self._stop = threading.Event()
        self._renewed = time.monotonic()

    # ---- one attempt -------------------------------------------------------------------------------

    def try_acquire_or_renew(self) -> bool:
        """One round: take the Lease when it is free, expired or ours; returns whether we hold it. An API
        server that does not answer (refused, reset, timed out: etcd stalled, a restart) is a failed round,
        never an exception: the renew loop must live on to notice when the Lease runs out."""
        try:
            return self._acquire_or_renew()
        except (urllib3.exceptions.HTTPError, OSError) as e:
            log.warning("Lease %s/%s: the API server did not answer: %s", self.namespace, self.name, e)
            return False

    def _acquire_or_renew(self) -> bool:
        now = _now()
        spec = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": int(self.lease_seconds),
            "renewTime": _micro(now),
        }
        try:
            lease = self.api.read_namespaced_lease(
                self.name, self.namespace, _request_timeout=self.renew_seconds
            )
        except ApiException as e:
            if e.status != 404:
                log.warning("reading Lease %s/%s: %s", self.namespace, self.name, e.reason)
                return False
            body = {
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": {**spec, "acquireTime": _micro(now), "leaseTransitions": 0},
            }
            try:
                self.api.create_namespaced_lease(self.namespace, body, _request_timeout=self.renew_seconds)
            except ApiException:
                return False
            return True
        holder = lease.spec.holder_identity or ""
        renewed = _parse(lease.spec.renew_time)
        duration = lease.spec.lease_duration_seconds or self.lease_seconds
        expired = renewed is None or (now - renewed).total_seconds() > duration
        if holder and holder != self.identity and not expired:
            return False
        if holder != self.identity:
            spec["acquireTime"] = _micro(now)
            spec["leaseTransitions"] = (lease.spec.lease_transitions or 0) + 1
        body = {
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "resourceVersion": lease.metadata.resource_version,
            },
            "spec": spec,
        }
        try:  # the resourceVersion makes the takeover atomic: of two standbys only one succeeds
            self.api.replace_namespaced_lease(
                self.name, self.namespace, body, _request_timeout=self.renew_seconds
            )
        except ApiException:
            return False
        return True

    # ---- loops -------------------------------------------------------------------------------------

    def acquire(self) -> bool:
        """Blocks until the Lease is ours (True) or `stop()` was called (False)."""
        while not self._stop.is_set():
            if self.try_acquire_or_renew():
                self.is_leader = True
                self._renewed = time.monotonic()
                log.info("leading as %s (Lease %s/%s)", self.identity, self.namespace, self.name)
                return True
            self._stop.wait(self.retry_seconds)
        return False

    def keep(self, on_lost: Callable[[], None]) -> threading.Thread:
        """Renews in a thread; calls `on_lost` (which must stop all acting) when renewal failed for longer
        than the Lease lasts, less a margin so the old leader stops before another one starts."""

        def loop() -> None:
            while not self._stop.wait(self.renew_seconds):
                if self.try_acquire_or_renew():
                    self._renewed = time.monotonic()
                elif time.monotonic() - self._renewed > self.lease_seconds - self.retry_seconds:
                    self.is_leader = False
                    log.error("lost the Lease %s/%s: stopping", self.namespace, self.name)
                    on_lost()
                    return

        thread = threading.Thread(target=loop, name="leader-election", daemon=True)
        thread.start()
        return thread

    def release(self) -> None:
        """On a clean shutdown: hand the Lease over at once instead of after it expires."""
        self._stop.set()
        if not self.is_leader:
            return
        try:
            lease = self.api.read_namespaced_lease(
                self.name, self.namespace, _request_timeout=self.renew_seconds
            )
            if lease.spec.holder_identity == self.identity:
                lease.spec.holder_identity = ""
                lease.spec.lease_duration_seconds = 1
                self.api.replace_namespaced_lease(
                    self.name, self.namespace, lease, _request_timeout=self.renew_seconds
                )
        except ApiException as e:
            log.warning("releasing the Lease: %s", e.reason)
        except (urllib3.exceptions.HTTPError, OSError) as e:
            log.warning("releasing the Lease: the API server did not answer: %s", e)
        self.is_leader = False

    def stop(self) -> None:
        self._stop.set()
