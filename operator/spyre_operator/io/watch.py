"""What the operator knows without asking: kopf's watches (with server-side label selectors) fill an
informer-style cache of models, their pods, their Service and claim changes and which of them have an
InferencePool; the resync walks the models the watch has seen. The reconcile decides from this and reads the
API server only before it acts."""

from __future__ import annotations

import json
import threading

from spyre_operator.io.workqueue import WorkQueue
from spyre_operator.settings import OperatorSettings

Key = tuple[str, str]


def plain(body) -> dict:
    """A kopf body as a plain dict that later events cannot change under us, without managedFields (the
    largest part of an object, and nothing the reconcile reads)."""
    plain = json.loads(json.dumps(body, default=dict))
    plain.get("metadata", {}).pop("managedFields", None)
    return plain


class WatchCache:
    """What kopf's watches delivered, as an informer keeps it: each model's latest body, its pods' latest
    bodies, and which of its owned objects (by kind: the Service and claim, the InferencePool) were checked
    for the model's current generation (their own watch events clear that). The reconcile decides from it
    and reads the API server only before acting."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[Key, dict] = {}
        self._pods: dict[Key, dict[str, dict]] = {}
        self._owned: dict[Key, dict[str, tuple]] = {}  # key -> {what was checked: the model's stamp}
        self._pools: set[Key] = set()  # models whose InferencePool the watch has seen (and not seen go)

    def model(self, key: Key) -> dict | None:
        with self._lock:
            return self._models.get(key)

    def put_model(self, key: Key, body: dict) -> None:
        with self._lock:
            self._models[key] = body

    def drop_model(self, key: Key) -> None:
        with self._lock:
            self._models.pop(key, None)
            self._owned.pop(key, None)

    def pods(self, key: Key) -> list[dict]:
        with self._lock:
            return list(self._pods.get(key, {}).values())

    def put_pod(self, key: Key, body: dict) -> None:
        with self._lock:
            self._pods.setdefault(key, {})[body["metadata"]["name"]] = body

    def drop_pod(self, key: Key, name: str) -> None:
        with self._lock:
            pods = self._pods.get(key, {})
            pods.pop(name, None)
            if not pods:
                self._pods.pop(key, None)

    def owned_stamp(self, key: Key, what: str) -> tuple | None:
        with self._lock:
            return self._owned.get(key, {}).get(what)

    def set_owned_stamp(self, key: Key, what: str, stamp: tuple) -> None:
        with self._lock:
            self._owned.setdefault(key, {})[what] = stamp

    def owned_changed(self, key: Key) -> None:
        with self._lock:
            self._owned.pop(key, None)

    def pool_seen(self, key: Key) -> bool:
        """Notes that the model has an InferencePool; True when that is news."""
        with self._lock:
            is_new = key not in self._pools
            self._pools.add(key)
            return is_new

    def pool_gone(self, key: Key) -> None:
        with self._lock:
            self._pools.discard(key)

    def has_pool(self, key: Key) -> bool:
        """Whether the watch has seen an InferencePool of the model (none seen: nothing to remove)."""
        with self._lock:
            return key in self._pools


class KnownModels:
    """The models kopf's watch has seen (added by events, removed on deletion): what the resync visits,
    with no list call of its own."""

    def __init__(self) -> None:
        self._keys: set[Key] = set()
        self._lock = threading.Lock()

    def add(self, key: Key) -> None:
        with self._lock:
            self._keys.add(key)

    def discard(self, key: Key) -> None:
        with self._lock:
            self._keys.discard(key)

    def snapshot(self) -> list[Key]:
        with self._lock:
            return sorted(self._keys)


class Resync:
    """Enqueues every known model once per `resync_seconds`, spread over the period (not all at once)."""

    def __init__(self, queue: WorkQueue, known: KnownModels, settings: OperatorSettings) -> None:
        self.queue = queue
        self.known = known
        self.settings = settings
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="resync", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        period = self.settings.resync_seconds
        while not self._stop.wait(period):
            keys = self.known.snapshot()
            for i, key in enumerate(keys):
                self.queue.add(key, delay=period * i / max(1, len(keys)))
