"""KV-cache events in vLLM's format (`--kv-events-config`): our encoding is vLLM 0.27.1's byte for byte (a
payload written by vLLM's own structs, tests/runtime/data/), the block manager records what enters and
leaves its prefix cache, and a ZeroMQ subscriber on 127.0.0.1 decodes what a real server publishes for a
request sequence: stored blocks for a prompt, the same hashes when a second prompt shares the prefix,
removed ones on eviction; with the flag off nothing is published, and a bad flag stops start-up with one
line. When vLLM's environment exists, vLLM's own decoder reads the published payloads too."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import zmq
from spyre_runtime.config import ConfigError, KVEventsConfig, RuntimeConfig
from spyre_runtime.engine.block_manager import BlockManager
from spyre_runtime.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ZmqEventPublisher,
    encode_batch,
    external_block_hash,
    parse_kv_events_config,
    publisher_for,
)

from tests.cluster.controlplane import free_port
from tests.httpclient import HTTP
from tests.runtime.serverproc import ServerProcess
from tests.runtime.vllm_reference import VLLM_VENV, load_table, vllm_source

CB_ENV = {
    "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager",
    "SENDNN_INFERENCE_USE_CB": "1",
    "SENDNN_INFERENCE_CB_DECODE_BATCH_SIZES": "1",
    "SENDNN_INFERENCE_CB_KV_LENS": "256",
}
# one sequence at a time, a pool of 5 blocks of 64 tokens (one sequence of 256 tokens, and one more)
CB_ARGS = ("--max-model-len", "256", "--max-num-seqs", "1", "--max-num-batched-tokens", "64")
CB_ARGS += ("--num-kv-blocks", "6")
STORED_KEYS = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
]


# ---- the format ------------------------------------------------------------------------------------


def test_our_payload_is_vllms_byte_for_byte():
    gold = load_table("kv_event_batch")
    events = [
        BlockStored((1, 2**64 - 1), None, tuple(range(128)), 64),
        BlockStored((7,), 2**64 - 1, tuple(range(300, 364)), 64),
        BlockRemoved((1,)),
        AllBlocksCleared(),
    ]
    assert encode_batch(gold["batch"]["ts"], events).hex() == gold["payload_hex"]


def test_block_hashes_are_unsigned_64_bit():
    assert external_block_hash(-1) == 2**64 - 1 and external_block_hash(5) == 5
    assert 0 <= external_block_hash(hash((0, (1, 2, 3)))) < 2**64


def test_block_manager_records_stored_and_removed_blocks():
    bm = BlockManager(num_blocks=5, block_size=4, record_events=True)  # 4 blocks besides scratch
    a = list(range(10))  # two full shareable blocks [0-3] [4-7]
    bm.allocate("a", a)
    bm.commit("a", 4)  # the first chunk: one block
    bm.commit("a", 10)
    h = [external_block_hash(x) for x in bm._hashes(a)]
    assert bm.take_events() == [
        BlockStored((h[0],), None, (0, 1, 2, 3), 4),
        BlockStored((h[1],), h[0], (4, 5, 6, 7), 4),
    ]
    assert bm.take_events() == []
    bm.free("a")
    b = [*range(8), 20, 21, 22, 23, 24]  # shares a's two blocks, one more full block
    assert bm.allocate("b", b).num_cached_tokens == 8
    bm.commit("b", len(b))
    h_b = [external_block_hash(x) for x in bm._hashes(b)]
    assert h_b[:2] == h  # the same blocks, the same hashes: only the new one is stored
    assert bm.take_events() == [BlockStored((h_b[2],), h[1], (20, 21, 22, 23), 4)]
    bm.free("b")
    bm.allocate("c", list(range(100, 113)))  # four blocks: every cached one is taken for new data
    assert sorted(e.block_hashes[0] for e in bm.take_events()) == sorted(h_b)
    quiet = BlockManager(num_blocks=5, block_size=4)
    quiet.allocate("a", a)
    quiet.commit("a", 10)
    assert quiet.events is None and quiet.take_events() == []


def test_the_flag_is_off_by_default_and_parsed_as_vllms():
    assert RuntimeConfig(model_dir=".", served_model_name="m").kv_events == KVEventsConfig()
    assert publisher_for(KVEventsConfig()) is None
    assert (
        publisher_for(parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}')) is None
    )
    on = parse_kv_events_config('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert on.is_enabled and on.publisher == "zmq" and on.endpoint == "tcp://*:5557"
    for bad, says in [
        ("{", "not valid JSON"),
        ("[1]", "expected a JSON object"),
        ('{"enable": true}', "unknown key 'enable'"),
        ('{"enable_kv_cache_events": "yes"}', "must be true or false"),
        ('{"publisher": "kafka"}', "must be 'zmq' or 'null'"),
        ('{"endpoint": "localhost:5557"}', "must start with tcp://"),
        ('{"max_queue_size": 0}', "max_queue_size=0 must be an integer >= 1"),
    ]:
        with pytest.raises(ConfigError, match="^--kv-events-config: .*" + says):
            parse_kv_events_config(bad)


def test_bad_flag_stops_start_up_with_one_line(tiny_model):
    for flag, says in [
        ("{not json", "not valid JSON"),
        ('{"enable_kv_cache_events": true, "hwm": -5}', "hwm=-5 must be an integer >= 0"),
    ]:
        argv = [sys.executable, "-m", "spyre_runtime.cli", "--log-level", "ERROR", "serve", str(tiny_model)]
        res = subprocess.run(
            [*argv, "--kv-events-config", flag],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 2, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("spyre-runtime: error: --kv-events-config: "), lines
        assert says in lines[0]


# ---- the publisher -----------------------------------------------------------------------------------


def subscriber(port: int, topic: bytes = b"") -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.bind(f"tcp://127.0.0.1:{port}")  # the publisher connects (vLLM's rule for a host:port endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    return sub


def settle(sub: zmq.Socket, seconds: float = 0.5) -> None:
    """Lets a bound SUB socket attach the publisher that connected to it and send its subscription (ZeroMQ
    does that only while the socket is used; a real subscriber polls all the time)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sub.poll(20)


def receive(
    sub: zmq.Socket, quiet_for: float = 1.0, raw: list[bytes] | None = None
) -> list[tuple[bytes, int, list]]:
    """Messages until none came for `quiet_for` seconds (at most 30 s): (topic, sequence number, decoded
    batch); the payloads as received are appended to `raw`."""
    got, end = [], time.monotonic() + 30
    while time.monotonic() < end and sub.poll(int(quiet_for * 1000)):
        topic, seq, payload = sub.recv_multipart()
        got.append((topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
        if raw is not None:
            raw.append(payload)
    return got


def test_publisher_sends_numbered_batches_replays_them_and_never_blocks():
    port, replay_port = free_port(), free_port()
    sub = subscriber(port, b"kv")
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://127.0.0.1:{port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        topic="kv",
    )
    pub = ZmqEventPublisher(config)
    try:
        settle(sub)
        for i in range(3):
            pub.publish([BlockRemoved((i,))], ts=100.0 + i)
        pub.publish([])  # nothing to send: no batch
        got = receive(sub)
        assert [(t, seq) for t, seq, _ in got] == [(b"kv", 0), (b"kv", 1), (b"kv", 2)]
        assert got[2][2] == [
            102.0,
            [{"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU", "group_idx": 0}],
            0,
        ]
        client = zmq.Context.instance().socket(zmq.DEALER)  # a REQ's envelope, many replies
        client.connect(f"tcp://127.0.0.1:{replay_port}")
        client.send_multipart([b"", (1).to_bytes(8, "big")])  # replay from batch 1 on
        replayed = []
        while client.poll(10_000):
            _, topic, seq, payload = client.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            replayed.append((topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
        client.close(linger=0)
        assert replayed == got[1:]
    finally:
        pub.shutdown()
        sub.close(linger=0)
    small = ZmqEventPublisher(KVEventsConfig(True, "zmq", f"tcp://127.0.0.1:{free_port()}", max_queue_size=1))
    try:
        t0 = time.monotonic()
        for _ in range(20_000):
            small.publish([AllBlocksCleared()])
        assert time.monotonic() - t0 < 5 and small.num_dropped > 0  # a full queue drops, never waits
    finally:
        small.shutdown()


# ---- a real server -----------------------------------------------------------------------------------


def serve_with_events(tiny_model, tmp_path, flag: dict, port: int) -> ServerProcess:
    args = (*CB_ARGS, "--kv-events-config", json.dumps({"endpoint": f"tcp://127.0.0.1:{port}", **flag}))
    return ServerProcess(tiny_model, CB_ENV, tmp_path / "server.log", extra_args=args)


def complete(srv: ServerProcess, prompt: str) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    assert HTTP.post(srv.base + "/v1/completions", json=body, timeout=60).status_code == 200


def tokens(srv: ServerProcess, prompt: str) -> list[int]:
    return HTTP.post(srv.base + "/tokenize", json={"model": "tiny", "prompt": prompt}, timeout=30).json()[
        "tokens"
    ]


def stored(batches: list) -> list[dict]:
    return [e for _, _, (_, events, _) in batches for e in events if e["type"] == "BlockStored"]


def chained(events: list[dict]) -> list[int]:
    """The block hashes of consecutive BlockStored events of one sequence, checking each event's parent
    is the block before its first."""
    hashes: list[int] = []
    for e in events:
        assert e["parent_block_hash"] == (hashes[-1] if hashes else None)
        hashes += e["block_hashes"]
    return hashes


def test_a_request_sequence_publishes_vllms_events(tiny_model, tmp_path):
    port = free_port()
    sub = subscriber(port, b"kv@tiny")
    srv = serve_with_events(tiny_model, tmp_path, {"enable_kv_cache_events": True, "topic": "kv@tiny"}, port)
    try:
        with srv.serving():
            settle(sub)
            prompt_a = "the same long prefix " * 10  # about 150 tokens: two full blocks
            prompt_b = prompt_a + "and a different ending " * 5  # the same two, a third
            ids_a, ids_b = tokens(srv, prompt_a), tokens(srv, prompt_b)
            assert ids_b[:128] == ids_a[:128] and len(ids_b) > 193
            complete(srv, prompt_a)
            payloads: list[bytes] = []
            first = receive(sub, raw=payloads)
            complete(srv, prompt_b)
            second = receive(sub, raw=payloads)
            for i in range(3):  # other long prompts take every block: the cached ones are evicted
                complete(srv, f"{i} unrelated words " * 16)
            third = receive(sub, raw=payloads)
    finally:
        sub.close(linger=0)
    expected = [external_block_hash(h) for h in BlockManager(2)._hashes(ids_b)][:3]
    # prompt A: its two full blocks, chained (an event for the blocks each prefill chunk completed)
    a = stored(first)
    assert chained(a) == expected[:2]
    assert [t for e in a for t in e["token_ids"]] == ids_a[:128]
    assert all(list(e) == STORED_KEYS and e["block_size"] == 64 and e["medium"] == "GPU" for e in a)
    assert all(e["extra_keys"] == [None] * len(e["block_hashes"]) and e["group_idx"] == 0 for e in a)
    assert all(e["lora_id"] is None and e["lora_name"] is None for e in a)
    # prompt B hits A's blocks (the same hashes, not stored again) and stores its third under them
    b = stored(second)
    assert [(e["block_hashes"], e["parent_block_hash"], e["token_ids"]) for e in b] == [
        ([expected[2]], expected[1], ids_b[128:192])
    ]
    removed = {
        h
        for _, _, (_, events, _) in third
        for e in events
        if e["type"] == "BlockRemoved"
        for h in e["block_hashes"]
    }
    assert set(expected) <= removed
    every = first + second + third
    assert [seq for _, seq, _ in every] == list(range(len(every)))  # numbered from 0, none lost
    assert all(
        topic == b"kv@tiny" and rank == 0 and abs(ts - time.time()) < 300 for topic, _, (ts, _, rank) in every
    )
    assert not [e for _, _, (_, events, _) in every for e in events if e["type"] == "AllBlocksCleared"]
    decoded_by_vllm(payloads, [batch for _, _, batch in every])


def decoded_by_vllm(payloads: list[bytes], batches: list) -> None:
    """vLLM's own decoder (msgspec over the structs of vllm/distributed/kv_events.py, from vLLM's
    environment or its wheel, its imports of the rest of vLLM stubbed) reads every payload we published back
    to the same values, field for field."""
    source = vllm_source("distributed/kv_events.py")
    python = VLLM_VENV / "bin/python" if (VLLM_VENV / ".vllm-ready").is_file() else Path(sys.executable)
    script = f"""
import json, logging, sys, types, importlib.util
for name in ["vllm", "vllm.config", "vllm.config.kv_events", "vllm.logger", "vllm.v1", "vllm.v1.core",
             "vllm.v1.core.kv_cache_utils"]:
    sys.modules[name] = types.ModuleType(name)
sys.modules["vllm.config.kv_events"].KVEventsConfig = object
sys.modules["vllm.logger"].init_logger = logging.getLogger
sys.modules["vllm.v1.core.kv_cache_utils"].ExternalBlockHash = bytes | int
spec = importlib.util.spec_from_file_location("kv_events", {str(source)!r})
kv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kv)
import msgspec
decoder = msgspec.msgpack.Decoder(kv.KVEventBatch)
print(json.dumps([msgspec.to_builtins(decoder.decode(bytes.fromhex(line))) for line in sys.stdin]))
"""
    res = subprocess.run(
        [str(python), "-c", script],
        input="\n".join(p.hex() for p in payloads),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == batches


def test_flag_off_publishes_nothing(tiny_model, tmp_path):
    port = free_port()
    sub = subscriber(port)
    srv = serve_with_events(tiny_model, tmp_path, {"enable_kv_cache_events": False}, port)
    try:
        with srv.serving():
            settle(sub)
            prompt = "the same long prefix " * 10
            complete(srv, prompt)
            complete(srv, prompt + "more")
            assert receive(sub, quiet_for=2.0) == []
    finally:
        sub.close(linger=0)
