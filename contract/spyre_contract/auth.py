"""Who may call a model (issue 40): the names the operator sets on a model's pod and the runtime reads.

- An API key reaches the runtime only by environment `valueFrom` a Secret, never as an argument; the runtime
  also reads `VLLM_API_KEY` as vLLM does. It guards the `/v1` routes; `/health` and `/metrics` stay open.
- Token authorization (`spec.auth.kubernetes`): the runtime checks a caller's bearer token with a TokenReview,
  then a SubjectAccessReview: may this user `get` this SpyreModel, by name, in this namespace?
- TLS (`spec.tls.secretName`): the Secret's `tls.crt` and `tls.key`, mounted at `TLS_MOUNT`."""

from __future__ import annotations

API_KEY_ENV = "SPYRE_API_KEY"
API_KEY_ENV_ALIASES = ("VLLM_API_KEY",)
AUTH_MODE_ENV = "SPYRE_AUTH"
AUTH_MODE_KUBERNETES = "kubernetes"
AUTH_MODES = (AUTH_MODE_KUBERNETES,)
# the SpyreModel a caller must be allowed to `get`, and its namespace
AUTH_MODEL_ENV = "SPYRE_AUTH_MODEL"
AUTH_NAMESPACE_ENV = "SPYRE_AUTH_NAMESPACE"
# how long an answer (allowed or denied) is kept, in seconds
AUTH_CACHE_SECONDS_ENV = "SPYRE_AUTH_CACHE_SECONDS"
AUTH_CACHE_SECONDS_DEFAULT = 10.0
# the access a caller needs: `get` on the SpyreModel
AUTH_GROUP = "spyre-serve.io"
AUTH_RESOURCE = "spyremodels"
AUTH_VERB = "get"
# TLS: the runtime serves HTTPS with these files when both are set
TLS_CERTFILE_ENV = "SPYRE_SSL_CERTFILE"
TLS_KEYFILE_ENV = "SPYRE_SSL_KEYFILE"
TLS_CA_CERTS_ENV = "SPYRE_SSL_CA_CERTS"
TLS_MOUNT = "/etc/spyre/tls"
TLS_CERT_KEY = "tls.crt"
TLS_KEY_KEY = "tls.key"
