"""One HTTP client for the tests' plain-HTTP requests to the servers they start.

`httpx.get` (and `openai.OpenAI` without an `http_client`) builds a new client, and with it a new SSL context
that loads the CA bundle: 25 ms of CPU a call on this machine, even for an http:// URL. The polling loops
(a server's /health until Ready, /metrics until a count moves, a client loop through a rollout) made several
of them a second, beside the servers they waited for. This client builds its context once. As with a client
per call, it sets no limit on connections (a test's concurrent requests never queue here) and keeps none idle:
each request opens its own, so a draining server's closed connection is never reused."""

import httpx
import openai

LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=0)
HTTP = httpx.Client(limits=LIMITS)


def openai_client(base_url: str, api_key: str = "unused", timeout: float = 60) -> openai.OpenAI:
    """The official client on the shared HTTP client, with no retries (a test sees every failure)."""
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout, http_client=HTTP)
