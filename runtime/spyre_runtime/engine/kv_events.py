"""KV-cache events in vLLM's wire format, so that a router that follows vLLM's prefix caches (llm-d's
precise prefix-cache scorer) follows ours: the block manager records what enters and leaves its prefix
cache, the server hands each step's events to a publisher thread, which sends them on a ZeroMQ PUB socket.

Wire format, as vLLM 0.27.1 encodes it (vllm/distributed/kv_events.py, msgspec msgpack): a three-frame
message (topic, sequence number as 8 bytes big-endian, payload); the payload is a msgpack array
`[ts, events, data_parallel_rank]` and each event a map tagged by `type`:

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None, "token_ids": [...],
     "block_size": 64, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None, ...],
     "group_idx": 0}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU", "group_idx": 0}
    {"type": "AllBlocksCleared"}

Block hashes are our prefix cache's chained hashes as unsigned 64-bit integers (vLLM's default,
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1). "GPU" is vLLM's name for the device's own KV cache (its other media
are CPU and storage offload tiers); consumers key tiers by it, so the accelerator's cache keeps it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields

from spyre_runtime.config import KV_EVENTS_FLAG, ConfigError, KVEventsConfig

log = logging.getLogger(__name__)

MEDIUM = "GPU"
HASH_MASK = (1 << 64) - 1
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # ends a replay


def parse_kv_events_config(text: str | None) -> KVEventsConfig:
    """The flag's JSON object -> KVEventsConfig; a ConfigError naming the flag for bad JSON or values."""
    if text is None:
        return KVEventsConfig()
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{KV_EVENTS_FLAG}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{KV_EVENTS_FLAG}: expected a JSON object, got {text!r}")
    known = {f.name: f for f in fields(KVEventsConfig)}
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(f"{KV_EVENTS_FLAG}: unknown key {key!r}; known keys: {', '.join(known)}")
        _check_kv_events_value(key, value, known[key].default)
    if "publisher" not in raw:
        raw["publisher"] = "zmq" if raw.get("enable_kv_cache_events") else "null"
    if raw["publisher"] not in ("null", "zmq"):
        raise ConfigError(f"{KV_EVENTS_FLAG}: publisher={raw['publisher']!r} must be 'zmq' or 'null'")
    for key in ("endpoint", "replay_endpoint"):
        value = raw.get(key)
        if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(
                f"{KV_EVENTS_FLAG}: {key}={value!r} must start with tcp://, ipc:// or inproc://"
            )
    return KVEventsConfig(**raw)


def _check_kv_events_value(key: str, value, default) -> None:
    if key == "replay_endpoint" or isinstance(default, str):
        ok = isinstance(value, str) or (key == "replay_endpoint" and value is None)
        want = "a string"
    elif isinstance(default, bool):
        ok, want = isinstance(value, bool), "true or false"
    else:
        least = 0 if key == "hwm" else 1  # a high-water mark of 0: no limit (ZeroMQ's meaning)
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= least
        want = f"an integer >= {least}"
    if not ok:
        raise ConfigError(f"{KV_EVENTS_FLAG}: {key}={json.dumps(value)} must be {want}")


def external_block_hash(content_hash: int) -> int:
    """The block manager's hash (a Python int, maybe negative) as the unsigned 64-bit id published."""
    return content_hash & HASH_MASK


@dataclass(frozen=True)
class BlockStored:
    """Consecutive blocks of one sequence entered the prefix cache; `token_ids` are all their tokens."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None  # the block before the first one, None at the start of the sequence
    token_ids: tuple[int, ...]
    block_size: int

    def wire(self) -> dict:
        return {
            "type": "BlockStored",
            "block_hashes": list(self.block_hashes),
            "parent_block_hash": self.parent_block_hash,
            "token_ids": list(self.token_ids),
            "block_size": self.block_size,
            "lora_id": None,
            "medium": MEDIUM,
            "lora_name": None,
            "extra_keys": [None] * len(self.block_hashes),
            "group_idx": 0,
        }


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks left the prefix cache (taken for new data)."""

    block_hashes: tuple[int, ...]

    def wire(self) -> dict:
        return {
            "type": "BlockRemoved",
            "block_hashes": list(self.block_hashes),
            "medium": MEDIUM,
            "group_idx": 0,
        }


@dataclass(frozen=True)
class AllBlocksCleared:
    def wire(self) -> dict:
        return {"type": "AllBlocksCleared"}


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def encode_batch(ts: float, events: list[KVCacheEvent], data_parallel_rank: int = 0) -> bytes:
    """One KVEventBatch payload, byte for byte as vLLM's msgspec encoder writes it."""
    import msgpack

    return msgpack.packb([float(ts), [e.wire() for e in events], data_parallel_rank], use_bin_type=True)


class ZmqEventPublisher:
    """Sends event batches from a thread of its own: `publish` never blocks the engine (a full queue drops
    the batch and counts it). Binds when the endpoint is a wildcard (`tcp://*:5557`), ipc:// or inproc://,
    else connects (vLLM's rule: the stable side binds). With `replay_endpoint`, a ROUTER socket answers a
    request holding a start sequence number (8 bytes big-endian) with the buffered batches from there on,
    then an end marker (sequence -1), as vLLM's publisher does."""

    def __init__(self, config: KVEventsConfig) -> None:
        import zmq

        self._zmq = zmq
        self.topic = config.topic.encode()
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = itertools.count()
        self.num_dropped = 0
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._loop, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVCacheEvent], ts: float | None = None) -> None:
        """Engine thread: queues one batch (the events of one step)."""
        if not events:
            return
        try:
            self._queue.put_nowait((time.time() if ts is None else ts, list(events)))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1:
                log.warning("KV-event queue full: dropping batches (the subscriber is not keeping up)")

    def shutdown(self, timeout: float = 1.0) -> None:
        """Sends what is queued (within `timeout`), then closes the sockets."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout=timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    def _loop(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                # idle: let the socket take in new subscribers and their subscriptions now, so that the
                # first batch after they joined reaches them (ZeroMQ does it only when the socket is used)
                self._pub.getsockopt(self._zmq.EVENTS)
                continue
            if item is None:
                return
            try:
                seq = next(self._seq)
                payload = encode_batch(*item)
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except Exception:
                log.exception("publishing KV events failed")
                time.sleep(0.1)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("ignoring a KV-event replay request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def publisher_for(config: KVEventsConfig) -> ZmqEventPublisher | None:
    """The publisher the flag asks for, or None (off, or publisher "null"). A socket that cannot bind or
    connect is a ConfigError naming the flag."""
    if not config.is_enabled:
        return None
    import zmq

    try:
        return ZmqEventPublisher(config)
    except zmq.ZMQError as e:
        where = f"{config.endpoint}" + (f" / {config.replay_endpoint}" if config.replay_endpoint else "")
        raise ConfigError(f"{KV_EVENTS_FLAG}: cannot open {where}: {e}") from None
