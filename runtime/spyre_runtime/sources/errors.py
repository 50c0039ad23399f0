"""One error type for the whole fetch: a readable sentence and whether a retry could help."""

from __future__ import annotations

import socket

NO_ROUTE_HINT = (
    "set spec.model.endpoint to a mirror the cluster can reach, or serve the model from a pvc:// or oci:// "
    "source"
)


class FetchError(Exception):
    """`transient` errors (network, truncated transfer) exit 1: the Job retries. Permanent ones
    (credentials, missing bucket/object/repo/revision, bad URI, no space, an unreachable endpoint or
    offline mode, a checksum that still mismatches after one retry) exit 2.

    `retries`: how often the run itself tries again before it gives up with this error; None means
    SPYRE_FETCH_RETRIES' tries for a transient error and none for a permanent one. An unreachable endpoint
    and a checksum mismatch are permanent but retried once here (a blip, a flipped bit in transit)."""

    def __init__(self, message: str, *, transient: bool, retries: int | None = None) -> None:
        super().__init__(message)
        self.transient = transient
        self.retries = retries

    @property
    def exit_code(self) -> int:
        return 1 if self.transient else 2


def unreachable(uri: str, endpoint: str, error: BaseException) -> FetchError:
    """No connection to the endpoint at all (name not resolved, connection refused, connect timed out):
    permanent after one retry, and the message says where the model can come from instead."""
    return FetchError(
        f"{uri}: cannot reach {endpoint} ({connect_failure(error)}); {NO_ROUTE_HINT}",
        transient=False,
        retries=1,
    )


def connect_failure(error: BaseException) -> str:
    """What stopped a connection, from the socket error under the client library's exception."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, socket.gaierror) or "name resolution" in str(seen) or "not known" in str(seen):
            return "the name does not resolve (DNS)"
        if isinstance(seen, ConnectionRefusedError) or "Connection refused" in str(seen):
            return "connection refused"
        if isinstance(seen, TimeoutError) or "timed out" in str(seen):
            return "the connection timed out"
        seen = seen.__cause__ or seen.__context__
    return f"no connection: {error}"
