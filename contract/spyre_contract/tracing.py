"""Request traces, between the operator and the runtime: the variable the operator sets on a model's pods
(OpenTelemetry's own, which the runtime reads as the exporter does) and what an endpoint must look like.
The runtime sends OTLP over HTTP (protobuf); an endpoint given without a path gets OTLP/HTTP's traces path."""

from __future__ import annotations

from urllib.parse import urlsplit

TRACES_ENDPOINT_VAR = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
SERVICE_NAME_VAR = "OTEL_SERVICE_NAME"
TRACES_PATH = "/v1/traces"
EXAMPLE = "http://otel-collector.monitoring:4318"


def endpoint_error(url: str) -> str | None:
    """Why `url` is not an OTLP/HTTP endpoint (http or https, a host, a valid port), or None."""
    if not isinstance(url, str):
        return f"must be a URL string, got {url!r}"
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{url!r} is not an OTLP/HTTP endpoint (want http(s)://HOST:PORT[/v1/traces], e.g. {EXAMPLE})"
    try:
        parts.port  # noqa: B018 - a port out of range raises here
    except ValueError as e:
        return f"{url!r} has a bad port ({e})"
    return None


def traces_url(url: str) -> str:
    """A checked endpoint (endpoint_error is None) as the traces URL: without a path, OTLP/HTTP's."""
    url = url.strip()
    return url.rstrip("/") + TRACES_PATH if urlsplit(url).path in ("", "/") else url
