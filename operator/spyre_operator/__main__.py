"""`spyre-operator`: reconcile SpyreModels into inference pods. Settings from SPYRE_OPERATOR_* or flags."""

from __future__ import annotations

import argparse
import logging
import sys

import kopf
from kubernetes import client, config

from spyre_operator.handlers import build_memo, build_registry
from spyre_operator.settings import SettingsError, add_flags, load_settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spyre-operator", description="The SpyreModel operator")
    add_flags(parser)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--liveness", default=None, help="e.g. http://0.0.0.0:8080/healthz")
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
    memo = build_memo(settings, api_client)
    kopf.run(
        registry=build_registry(settings),
        memo=memo,
        standalone=True,
        clusterwide=not settings.namespaces,
        namespaces=list(settings.namespaces),
        liveness_endpoint=args.liveness,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
