"""`spyre-operator`: reconcile SpyreModels into inference pods. Settings from SPYRE_OPERATOR_* or flags."""

from __future__ import annotations

import argparse
import collections
import logging
import os
import socket
import sys
import time

import kopf
from kubernetes import client, config

from spyre_operator.handlers import build_memo, build_registry
from spyre_operator.io.leader import LeaderElection
from spyre_operator.io.metrics import OperatorMetrics, serve_health
from spyre_operator.io.spyre_stack import resolve_scheduler
from spyre_operator.settings import SettingsError, add_flags, load_settings

EXIT_LOST_LEASE = 3
RESTARTS_PER_10_MIN = 5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spyre-operator", description="The SpyreModel operator")
    add_flags(parser)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = load_settings(flags=args)
    except SettingsError as e:
        print(f"spyre-operator: error: {e}", file=sys.stderr)
        return 2
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    api_client = client.ApiClient()
    settings = resolve_scheduler(settings, api_client)  # spyre-scheduler when the Spyre operator is there
    metrics = OperatorMetrics()
    elector = None
    # named here, not by kopf: kopf's default looks the uid up in /etc/passwd, where the arbitrary uid a
    # restricted platform runs the container as has no entry (KeyError: getpwuid(); found on a real node)
    identity = os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
    if settings.leader_election:
        elector = LeaderElection(
            api_client,
            settings.lease_namespace,
            settings.lease_name,
            identity,
            lease_seconds=settings.lease_seconds,
            renew_seconds=max(1.0, settings.lease_seconds / 3),
            retry_seconds=max(0.5, settings.lease_seconds / 7),
        )
        metrics.is_leader = lambda: elector.is_leader
    if settings.health_port:
        serve_health(settings.health_port, metrics, lambda: True, settings.health_host)
    if elector is not None:
        logging.getLogger(__name__).info(
            "waiting for the Lease %s/%s", settings.lease_namespace, settings.lease_name
        )
        if not elector.acquire():
            return 0
        # a leader that cannot renew stops at once: the kubelet restarts it as a standby
        elector.keep(on_lost=lambda: os._exit(EXIT_LOST_LEASE))
    try:
        run_reactor(settings, api_client, metrics, identity)
    finally:
        if elector is not None:
            elector.release()
    return 0


class RestartBudget:
    """At most `limit` restarts within any `window` seconds: `spend(now)` is True while one more may be."""

    def __init__(self, limit: int = RESTARTS_PER_10_MIN, window: float = 600.0) -> None:
        self.limit, self.window = limit, window
        self.times: collections.deque[float] = collections.deque()

    def spend(self, now: float) -> bool:
        self.times.append(now)
        while now - self.times[0] > self.window:
            self.times.popleft()
        return len(self.times) <= self.limit


def run_reactor(settings, api_client, metrics: OperatorMetrics, identity: str) -> None:
    """kopf's reactor, run again (with fresh state) when a watch met 404 Not Found: an optional API (the
    InferencePool CRD) removed while watched. kopf follows CRDs and stops the watch of one that goes, but a
    watch that starts as the CRD goes is answered 404, which kopf treats as fatal: the whole operator stopped
    (found in `make test`, where a test removes the CRD). Any other fatal error stops the process, and so do
    more than RESTARTS_PER_10_MIN such restarts."""
    budget = RestartBudget()
    while True:
        try:
            kopf.run(
                registry=build_registry(settings),
                memo=build_memo(settings, api_client, metrics),
                standalone=True,  # leader election above, not kopf's peering
                identity=identity,
                clusterwide=not settings.namespaces,
                namespaces=list(settings.namespaces),
            )
            return
        except Exception as e:
            if getattr(e, "status", None) != 404 or not budget.spend(time.monotonic()):
                raise
            logging.getLogger(__name__).warning(
                "a watch was answered 404 (%s): an API went away while watched; watching again", e
            )


if __name__ == "__main__":
    sys.exit(main())
