"""What the operator knows without asking: kopf's watches (with server-side label selectors) fill an
informer-style cache of models, their pods, their Service and claim changes and which of them have an
InferencePool; the resync walks the models the watch has seen. The reconcile decides and acts from this: the
pods' cache is whole from the first reconcile on (kopf holds every handler until its pod index has listed
them), and it knows which of the operator's own pod writes the watch has not shown yet (expectations, as
Kubernetes' ReplicaSet controller keeps them), so a pass never acts twice on a lagging view."""

from __future__ import annotations

import json
import sys
import threading
import time

from spyre_operator.io.workqueue import WorkQueue
from spyre_operator.settings import OperatorSettings

Key = tuple[str, str]
# how long the watch may take to show a pod the operator created or deleted; past it the cache cannot answer
# for that model (the event was lost, or came and went within one batch) and the pods are listed again
EXPECT_SECONDS = 30.0


def plain(body) -> dict:
    """A kopf body as a plain dict that later events cannot change under us, without managedFields (the
    largest part of an object, and nothing the reconcile reads). Its keys and short strings are interned:
    a thousand models' pods spell the same field names and mostly the same values, held once (the cached
    bodies take about 40% less memory)."""
    plain = json.loads(json.dumps(body, default=dict), object_pairs_hook=_interned)
    plain.get("metadata", {}).pop("managedFields", None)
    return plain


def _interned(pairs: list[tuple[str, object]]) -> dict:
    return {sys.intern(k): sys.intern(v) if type(v) is str and len(v) <= 64 else v for k, v in pairs}


class WatchCache:
    """What kopf's watches delivered, as an informer keeps it: each model's latest body, its pods' latest
    bodies, and which of its owned objects (by kind: the Service and claim, the InferencePool) were checked
    for the model's current generation (their own watch events clear that), and the operator's own pod
    writes its watch has yet to show. The reconcile decides and acts from it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[Key, dict] = {}
        self._pods: dict[Key, dict[str, dict]] = {}
        self._owned: dict[Key, dict[str, tuple]] = {}  # key -> {what was checked: the model's stamp}
        self._pools: set[Key] = set()  # models whose InferencePool the watch has seen (and not seen go)
        self._pools_reported: set[Key] = set()  # of those, the ones the pool watch itself has reported
        self._policies: set[Key] = set()  # models whose NetworkPolicy the watch has seen (and not seen go)
        # the operator's own pod writes the watch has not shown yet: key -> {pod name: (created?, deadline)}
        self._expected: dict[Key, dict[str, tuple[bool, float]]] = {}

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
            self._expected.pop(key, None)

    def pods(self, key: Key) -> list[dict]:
        with self._lock:
            return list(self._pods.get(key, {}).values())

    def put_pod(self, key: Key, body: dict) -> None:
        name = body["metadata"]["name"]
        with self._lock:
            self._pods.setdefault(key, {})[name] = body
            expected = self._expected.get(key, {}).get(name)
            if expected is not None and (expected[0] or body["metadata"].get("deletionTimestamp")):
                self._seen(key, name)

    def drop_pod(self, key: Key, name: str) -> None:
        with self._lock:
            pods = self._pods.get(key, {})
            pods.pop(name, None)
            if not pods:
                self._pods.pop(key, None)
            self._seen(key, name)

    # ---- the operator's own pod writes, until the watch shows them ----------------------------------------

    def expect(self, key: Key, created: list[str], deleted: list[str]) -> None:
        """Notes pods the operator just created and deleted; each counts until the watch shows it (created:
        there; deleted: terminating or gone). One the watch showed already (its event came before the API
        server's answer) is no longer expected."""
        deadline = time.monotonic() + EXPECT_SECONDS
        with self._lock:
            pods = self._pods.get(key, {})
            waiting = self._expected.setdefault(key, {})
            for name in created:
                if name not in pods:
                    waiting[name] = (True, deadline)
            for name in deleted:
                if name in pods and not pods[name]["metadata"].get("deletionTimestamp"):
                    waiting[name] = (False, deadline)
            if not waiting:
                self._expected.pop(key, None)

    def unseen_writes(self, key: Key) -> float | None:
        """None when the cache shows every pod write of the operator's for the model; else the seconds left
        until the oldest unseen one is overdue (0 when it is: the cache cannot answer, list the pods)."""
        with self._lock:
            waiting = self._expected.get(key)
            if not waiting:
                return None
            return max(0.0, min(deadline for _, deadline in waiting.values()) - time.monotonic())

    def relisted(self, key: Key, listed: list[dict], version: str) -> None:
        """The model's pods as just listed from the API server (the list's resourceVersion `version`), where
        the watch showed too little in time. A cached pod the list lacks and older than the list was deleted
        unseen (a watch that restarts after 410 Gone lists again, without DELETED events) and goes; where the
        list and the cache still disagree, the watch is expected to catch up, as after the operator's writes
        (else the pods are listed again when that is overdue)."""
        deadline = time.monotonic() + EXPECT_SECONDS
        names = {p["metadata"]["name"] for p in listed}
        with self._lock:
            pods = self._pods.get(key, {})
            for name in [n for n, body in pods.items() if n not in names and _older(body, version)]:
                del pods[name]
            waiting = {n: (True, deadline) for n in names if n not in pods}
            for name, body in pods.items():
                if name not in names and not body["metadata"].get("deletionTimestamp"):
                    waiting[name] = (False, deadline)
            if waiting:
                self._expected[key] = waiting
            else:
                self._expected.pop(key, None)

    def _seen(self, key: Key, name: str) -> None:
        waiting = self._expected.get(key)
        if waiting is not None and waiting.pop(name, None) is not None and not waiting:
            self._expected.pop(key, None)

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
            self._pools_reported.discard(key)

    def pool_reported(self, key: Key) -> None:
        """Notes that the pool watch has delivered an event of the model's InferencePool (it is watched)."""
        with self._lock:
            self._pools_reported.add(key)

    def is_pool_reported(self, key: Key) -> bool:
        with self._lock:
            return key in self._pools_reported

    def has_pool(self, key: Key) -> bool:
        """Whether the watch has seen an InferencePool of the model (none seen: nothing to remove)."""
        with self._lock:
            return key in self._pools

    def policy_seen(self, key: Key, is_there: bool) -> None:
        """Notes whether the model has a NetworkPolicy (its watch's last word)."""
        with self._lock:
            (self._policies.add if is_there else self._policies.discard)(key)

    def has_policy(self, key: Key) -> bool:
        """Whether the watch has seen a NetworkPolicy of the model (none seen: nothing to remove)."""
        with self._lock:
            return key in self._policies


def _older(body: dict, version: str) -> bool:
    """Whether the object's resourceVersion is before `version` (etcd's revisions, compared as numbers when
    both are; else not known to be older)."""
    mine = body["metadata"].get("resourceVersion", "")
    return mine.isdigit() and version.isdigit() and int(mine) < int(version)


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
