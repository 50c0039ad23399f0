"""Issue 37's model-source hardening, against moto and the hub stand-in through `spyre-runtime fetch-model`:
S3 objects whose ETag is not an MD5 (SSE-KMS) and multipart objects of unequal parts are served, a real
corruption is still caught (and is permanent after one retry); hf:// fetches only what the runtime reads;
an unreachable or offline endpoint is said plainly."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import socket

import pytest
from spyre_runtime.sources.errors import connect_failure
from spyre_runtime.sources.fetch import fetch_model
from spyre_runtime.sources.hf import INCLUDE_ENV, wanted

from tests.cluster.controlplane import free_port
from tests.cluster.hfhub import HfHub
from tests.cluster.s3server import MIN_PART_SIZE, S3Server
from tests.runtime.sources.test_fetch_model import fetch, last_line, same_files

DATA = random.Random(37).randbytes(3 * MIN_PART_SIZE + 1234)
SINGLE = b"a small SSE-KMS object\n" * 100


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    try:
        client = server.client()
        client.create_bucket(Bucket="models")
        key_id = server._client("kms").create_key()["KeyMetadata"]["KeyId"]
        kms = {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": key_id}
        client.put_object(Bucket="models", Key="kms/config.json", Body=SINGLE, **kms)
        server.put_parts("models", "kms/model.safetensors", DATA, [MIN_PART_SIZE, MIN_PART_SIZE], **kms)
        # parts of unequal sizes: the first longer than the second, the last short
        server.put_parts("models", "parts/model.safetensors", DATA, [MIN_PART_SIZE + 5000, MIN_PART_SIZE])
        short = [MIN_PART_SIZE + 1000, MIN_PART_SIZE + 1000]  # equal parts, then a shorter last one
        server.put_parts("models", "short/model.safetensors", DATA, short)
        server.put_parts(
            "models",
            "sha/model.safetensors",
            DATA,
            [MIN_PART_SIZE + 7, MIN_PART_SIZE],
            ChecksumAlgorithm="SHA256",
        )
        yield server
    finally:
        server.stop()


@pytest.fixture
def env(s3):
    yield {**s3.credentials, "AWS_ENDPOINT_URL": s3.endpoint}
    s3.corrupt.clear()


def kinds(into) -> dict[str, str | None]:
    manifest = json.loads((into / ".spyre-model.json").read_text())
    return {f["name"]: f["checksum"] for f in manifest["files"]}


def test_sse_kms_etag_is_not_taken_for_an_md5(s3, env, tmp_path):
    head = s3.client().head_object(Bucket="models", Key="kms/config.json")
    assert head["ServerSideEncryption"] == "aws:kms"
    assert head["ETag"].strip('"') != hashlib.md5(SINGLE).hexdigest()  # as on AWS: not the MD5
    res = fetch("s3://models/kms", tmp_path / "m", env)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "m/config.json").read_bytes() == SINGLE
    assert (tmp_path / "m/model.safetensors").read_bytes() == DATA
    # the single-part object's CRC32 (boto3 sends one) is verified; the multipart one has none: size only
    assert kinds(tmp_path / "m") == {"config.json": "crc32", "model.safetensors": None}


@pytest.mark.parametrize(
    "prefix, kind",
    [("parts", "s3-multipart"), ("short", "s3-multipart"), ("sha", "s3-composite-sha256")],
)
def test_multipart_parts_of_any_size_are_served(s3, env, prefix, kind, tmp_path):
    res = fetch(f"s3://models/{prefix}", tmp_path / "m", env)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "m/model.safetensors").read_bytes() == DATA
    assert kinds(tmp_path / "m") == {"model.safetensors": kind}


@pytest.mark.parametrize(
    "key, kind",
    [
        ("parts/model.safetensors", "s3-multipart"),
        ("sha/model.safetensors", "s3-composite-sha256"),
        ("kms/config.json", "crc32"),
    ],
)
def test_corruption_is_caught_and_permanent_after_one_retry(s3, env, key, kind, tmp_path):
    prefix, name = key.split("/")
    s3.corrupt.add(f"models/{key}")
    start = len(s3.log)
    res = fetch(f"s3://models/{prefix}", tmp_path / "m", {**env, "SPYRE_FETCH_RETRIES": "5"})
    assert res.returncode == 2, res.stderr
    assert f"s3://models/{prefix}: file {name}: checksum mismatch ({kind} expected" in last_line(res)
    gets = [r for r in s3.log[start:] if r.method == "GET" and r.path.endswith(key)]
    assert len(gets) == 2  # one retry, not SPYRE_FETCH_RETRIES' five tries
    assert "(try 1 of 2; again in" in res.stderr
    assert not (tmp_path / "m").exists() and not (tmp_path / "m.partial" / name).exists()


# ---- hf:// fetches what the runtime reads ---------------------------------------------------------


@pytest.fixture(scope="module")
def hub(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("extras") / "repo"
    shutil.copytree(tiny_model, folder)
    (folder / "original").mkdir()
    (folder / "consolidated.safetensors").write_bytes(b"\0" * 50_000)
    (folder / "original/consolidated.pth").write_bytes(b"\1" * 60_000)
    (folder / "original/params.json").write_text("{}")
    (folder / "model-q4.gguf").write_bytes(b"\2" * 70_000)
    with HfHub(tmp_path_factory.mktemp("hub")) as server:
        server.add_model("org/extras", folder)
        yield server


EXTRAS = {"consolidated.safetensors", "original/consolidated.pth", "original/params.json", "model-q4.gguf"}


def test_hf_fetches_only_what_the_runtime_reads(hub, tiny_model, tmp_path):
    need = sum(p.stat().st_size for p in tiny_model.iterdir())
    seen = len(hub.log)
    manifest = fetch_model(
        "hf://org/extras", tmp_path / "m", env={"HF_ENDPOINT": hub.endpoint}, free=lambda path: need
    )  # the volume holds exactly the runtime's files: the extras are not counted in the space check
    assert manifest["total_bytes"] == need
    assert same_files(tiny_model, tmp_path / "m")
    fetched = {r.path.split("/resolve/")[1].split("/", 1)[1] for r in hub.file_gets()[seen:]}
    assert fetched == {p.name for p in tiny_model.iterdir()} and not fetched & EXTRAS


def test_hf_include_adds_patterns(hub, tiny_model, tmp_path):
    res = fetch(
        "hf://org/extras", tmp_path / "m", {"HF_ENDPOINT": hub.endpoint, INCLUDE_ENV: "*.gguf, original/*"}
    )
    assert res.returncode == 0, res.stderr
    got = {p.relative_to(tmp_path / "m").as_posix() for p in (tmp_path / "m").rglob("*") if p.is_file()}
    assert got - {p.name for p in tiny_model.iterdir()} == EXTRAS - {"consolidated.safetensors"} | {
        ".spyre-model.json"
    }


@pytest.mark.parametrize(
    "name, read",
    [
        ("config.json", True),
        ("tokenizer.model", True),
        ("chat_template.jinja", True),
        ("model-00001-of-00002.safetensors", True),
        ("model.safetensors.index.json", True),
        ("1_Pooling/config.json", True),
        ("consolidated.safetensors", False),
        ("original/params.json", False),
        ("original/consolidated.00.pth", False),
        ("pytorch_model.bin", False),
        ("model.gguf", False),
        ("README.md", False),
    ],
)
def test_runtime_files(name, read):
    assert wanted(name) is read


# ---- no network, told plainly ---------------------------------------------------------------------

HINT = "set spec.model.endpoint to a mirror the cluster can reach, or serve the model from a pvc:// or oci://"


@pytest.mark.parametrize("scheme", ["hf", "s3"])
def test_unreachable_endpoint_is_permanent_and_says_what_to_do(scheme, tmp_path):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    if scheme == "hf":
        source, env = "hf://org/tiny", {"HF_ENDPOINT": endpoint}
    else:
        source = "s3://models/tiny"
        env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "AKIA0", "AWS_SECRET_ACCESS_KEY": "x"}
    res = fetch(source, tmp_path / "m", {**env, "SPYRE_FETCH_RETRIES": "5"})
    assert res.returncode == 2, res.stderr
    assert last_line(res) == f"{source}: cannot reach {endpoint} (connection refused); {HINT} source"
    assert res.stderr.count("(try 1 of 2; again in") == 1  # one retry, then the final line
    assert not (tmp_path / "m").exists()


def test_hf_offline_is_permanent_without_a_request(tmp_path):
    with HfHub(tmp_path / "hub") as hub:
        endpoint = hub.endpoint
        res = fetch("hf://org/tiny", tmp_path / "m", {"HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "1"})
        assert hub.log == []
    assert res.returncode == 2 and res.stderr.strip() == last_line(res), res.stderr
    offline = f"hf://org/tiny: HF_HUB_OFFLINE=1 forbids reaching the hub at {endpoint}"
    assert last_line(res) == f"{offline}; unset it, or {HINT} source"


@pytest.mark.parametrize(
    "error, said",
    [
        (socket.gaierror(-2, "Name or service not known"), "the name does not resolve (DNS)"),
        (ConnectionRefusedError(111, "Connection refused"), "connection refused"),
        (TimeoutError("timed out"), "the connection timed out"),
    ],
)
def test_connect_failures_are_named(error, said):
    wrapped = RuntimeError("client error")
    wrapped.__cause__ = error
    assert connect_failure(wrapped) == said
