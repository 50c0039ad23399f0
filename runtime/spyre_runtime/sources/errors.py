"""One error type for the whole fetch: a readable sentence and whether a retry could help."""

from __future__ import annotations


class FetchError(Exception):
    """`transient` errors (network, truncated transfer, checksum mismatch) exit 1: the Job retries.
    Permanent ones (credentials, missing bucket/object/repo/revision, bad URI, no space) exit 2."""

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient

    @property
    def exit_code(self) -> int:
        return 1 if self.transient else 2
