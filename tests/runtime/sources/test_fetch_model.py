"""`spyre-runtime fetch-model` against a real S3-compatible server (moto, IAM auth on) and a local hub
endpoint served to the real huggingface_hub client: verified, atomic, cached, resumed, and every failure
a readable last line with exit 1 (transient) or 2 (permanent) and nothing published."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from spyre_runtime.config import load_config
from spyre_runtime.sources.errors import FetchError
from spyre_runtime.sources.fetch import check_space, fetch_model
from spyre_runtime.sources.progress import Progress
from spyre_runtime.sources.remote import Listing
from spyre_runtime.sources.staging import Staging
from spyre_runtime.sources.uri import HfSource, S3Source, parse_source

from tests.cluster.hfhub import HfHub
from tests.cluster.s3server import S3Server

_FOREIGN = ("AWS_", "HF_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE", "POD_NAME", "POD_NAMESPACE", "KUBECONFIG")


def fetch(source: str, into: Path, env: dict, *extra: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN)}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "spyre_runtime.cli",
            "fetch-model",
            "--source",
            source,
            "--into",
            str(into),
            *extra,
        ],
        capture_output=True,
        text=True,
        env={**base, "SPYRE_FETCH_RETRIES": "2", **env},
        timeout=120,
    )


def last_line(res: subprocess.CompletedProcess) -> str:
    return res.stderr.strip().splitlines()[-1]


def events(res: subprocess.CompletedProcess) -> list[dict]:
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    return names == sorted(
        p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file() and p.name != ".spyre-model.json"
    ) and all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


@pytest.fixture(scope="module")
def s3(tiny_model, tmp_path_factory):
    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    try:
        server.put_folder("models", "llama/tiny", tiny_model)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def s3_env(s3):
    return {**s3.credentials, "AWS_ENDPOINT_URL": s3.endpoint}


@pytest.fixture(scope="module")
def hub(tiny_model, tmp_path_factory):
    with HfHub(tmp_path_factory.mktemp("hub")) as server:
        server.add_model("org/tiny", tiny_model)
        server.add_model("org/tiny", tiny_model, revision="v1")
        yield server


@pytest.fixture
def clean_hub(hub):
    yield hub
    hub.token, hub.truncate, hub.corrupt = None, {}, set()


@pytest.mark.parametrize(
    "uri, parsed",
    [
        (
            "hf://ibm-granite/granite-3.3-2b",
            HfSource("hf://ibm-granite/granite-3.3-2b", "ibm-granite/granite-3.3-2b", "main"),
        ),
        ("hf://org/m@v1.2", HfSource("hf://org/m@v1.2", "org/m", "v1.2")),
        ("s3://bucket/a/b/", S3Source("s3://bucket/a/b/", "bucket", "a/b")),
        ("s3://bucket", None),  # a prefix is required (issue 37: one grammar with the operator and the CRD)
        ("gs://bucket/x", None),
        ("hf://only-name", None),
        ("s3://Bad_Bucket/x", None),
    ],
)
def test_parse_source(uri, parsed):
    if parsed is None:
        with pytest.raises(FetchError, match="is not a model source") as err:
            parse_source(uri)
        assert err.value.exit_code == 2
    else:
        assert parse_source(uri) == parsed


def test_bad_uri_exits_2_naming_it(tmp_path):
    res = fetch("gs://bucket/model", tmp_path / "m", {})
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [last_line(res)]
    assert "'gs://bucket/model' is not a model source" in last_line(res)
    assert not (tmp_path / "m").exists()


def test_s3_fetch_verifies_publishes_and_serves(s3, s3_env, tiny_model, tmp_path):
    into = tmp_path / "cache" / "tiny"
    res = fetch("s3://models/llama/tiny", into, s3.credentials, "--endpoint", s3.endpoint)
    assert res.returncode == 0, res.stderr
    assert same_files(tiny_model, into) and not into.with_name("tiny.partial").exists()
    manifest = json.loads((into / ".spyre-model.json").read_text())
    kinds = {f["name"]: f["checksum"] for f in manifest["files"]}
    assert kinds["model.safetensors"] == "s3-multipart" and kinds["config.json"] == "md5"
    assert manifest["total_bytes"] == sum(p.stat().st_size for p in tiny_model.iterdir())
    progress, done = events(res)[:-1], events(res)[-1]
    assert (
        progress[0]["done"] == 0 and progress[-1]["done"] == progress[-1]["total"] == manifest["total_bytes"]
    )
    assert all(e["event"] == "progress" for e in progress) and done["event"] == "done"
    assert done["downloaded"] == manifest["total_bytes"] and done["files"] == len(manifest["files"])
    assert load_config(into).model_dir == into
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello", "max_tokens": 4, "ignore_eos": True}) + "\n")
    generated = subprocess.run(
        [
            sys.executable,
            "-m",
            "spyre_runtime.cli",
            "--log-level",
            "WARNING",
            "generate",
            str(into),
            "--prompts",
            str(prompts),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager"},
        timeout=300,
    )
    assert generated.returncode == 0 and len(json.loads(generated.stdout)["token_ids"]) == 4, generated.stderr

    gets = len(s3.object_gets())
    again = fetch("s3://models/llama/tiny", into, s3_env)
    assert again.returncode == 0, again.stderr
    assert (
        again.stdout == f"cached: {into} ({manifest['total_bytes']} bytes, {len(manifest['files'])} files)\n"
    )
    assert len(s3.object_gets()) == gets


@pytest.mark.parametrize(
    "source, env, message",
    [
        (
            "s3://models/llama/tiny",
            {"AWS_ACCESS_KEY_ID": "AKIAIOSFODNN7EXAMPLE"},
            "access denied (InvalidAccessKeyId)",
        ),
        (
            "s3://models/llama/tiny",
            {"AWS_SECRET_ACCESS_KEY": "wrong"},
            "access denied (SignatureDoesNotMatch)",
        ),
        ("s3://no-such-bucket/tiny", {}, "bucket 'no-such-bucket' not found (NoSuchBucket)"),
        ("s3://models/llama/nothing-here", {}, "no objects under this prefix"),
    ],
)
def test_s3_permanent_failures(s3, s3_env, source, env, message, tmp_path):
    res = fetch(source, tmp_path / "m", {**s3_env, **env})
    assert res.returncode == 2, res.stderr
    assert last_line(res).startswith(f"{source}: {message}") and s3.endpoint in last_line(res)
    assert not (tmp_path / "m").exists()


def test_s3_truncated_transfer_then_resume(s3, s3_env, tiny_model, tmp_path):
    into, size = tmp_path / "tiny", (tiny_model / "model.safetensors").stat().st_size
    s3.truncate["models/llama/tiny/model.safetensors"] = size // 2
    try:
        res = fetch("s3://models/llama/tiny", into, s3_env)
    finally:
        s3.truncate.clear()
    assert res.returncode == 1, res.stderr
    message = re.search(
        r"file model.safetensors: expected (\d+) bytes, got (\d+) \(truncated transfer", last_line(res)
    )
    assert message and int(message[1]) == size, last_line(res)
    kept = int(message[2])  # what arrived before the cut, less at most the read it broke
    assert 0 < kept <= size // 2 and not into.exists()
    assert (tmp_path / "tiny.partial/model.safetensors").stat().st_size == kept

    start = len(s3.log)
    res = fetch("s3://models/llama/tiny", into, s3_env)
    assert res.returncode == 0, res.stderr
    gets = [
        (r.range, r.body_bytes) for r in s3.log[start:] if r.method == "GET" and "model.safetensors" in r.path
    ]
    assert gets == [(f"bytes={kept}-", size - kept)]
    assert same_files(tiny_model, into)


def test_hf_fetch_then_cached_without_file_requests(clean_hub, tiny_model, tmp_path):
    hub, into = clean_hub, tmp_path / "tiny"
    res = fetch("hf://org/tiny@v1", into, {"HF_ENDPOINT": hub.endpoint})
    assert res.returncode == 0, res.stderr
    assert same_files(tiny_model, into)
    manifest = json.loads((into / ".spyre-model.json").read_text())
    assert manifest["revision"] == "v1" and manifest["commit"] == hub.repos["org/tiny"]["v1"]
    kinds = {f["name"]: f["checksum"] for f in manifest["files"]}
    assert kinds["model.safetensors"] == "sha256" and kinds["config.json"] == "git-sha1"
    seen = len(hub.log)
    again = fetch("hf://org/tiny@v1", into, {"HF_ENDPOINT": hub.endpoint})
    assert again.returncode == 0 and again.stdout.startswith(f"cached: {into} (")
    assert len(hub.log) == seen  # not even the file list was asked for


def test_hf_token(clean_hub, tmp_path):
    hub = clean_hub
    hub.token = "hf_right"
    cases = [
        ({}, 2, "repository not found (or it is private: set HF_TOKEN)"),
        ({"HF_TOKEN": "hf_wrong"}, 2, "access denied (HTTP 401: check HF_TOKEN)"),
    ]
    for env, code, message in cases:
        res = fetch("hf://org/tiny", tmp_path / "m", {"HF_ENDPOINT": hub.endpoint, **env})
        assert (res.returncode, message in last_line(res)) == (code, True), res.stderr
        assert not (tmp_path / "m").exists()
    res = fetch("hf://org/tiny", tmp_path / "m", {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": "hf_right"})
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize(
    "source, message",
    [
        ("hf://org/tiny@no-such-tag", "hf://org/tiny@no-such-tag: revision 'no-such-tag' not found"),
        ("hf://org/absent", "hf://org/absent: repository not found"),
    ],
)
def test_hf_missing(clean_hub, source, message, tmp_path):
    res = fetch(source, tmp_path / "m", {}, "--endpoint", clean_hub.endpoint)
    assert res.returncode == 2 and last_line(res).startswith(message), res.stderr
    assert not (tmp_path / "m").exists()


def test_truncated_transfer_then_resume(clean_hub, tiny_model, tmp_path):
    hub, into = clean_hub, tmp_path / "tiny"
    size = (tiny_model / "model.safetensors").stat().st_size
    cut = size // 3
    hub.truncate["model.safetensors"] = cut
    first = len(hub.log)
    res = fetch("hf://org/tiny", into, {"HF_ENDPOINT": hub.endpoint})
    assert res.returncode == 1, res.stderr
    assert (
        f"hf://org/tiny: file model.safetensors: expected {size} bytes, got {cut} (truncated transfer"
        in last_line(res)
    )
    assert not into.exists() and (tmp_path / "tiny.partial/model.safetensors").stat().st_size == cut
    tries = [r for r in hub.log[first:] if r.path.endswith("/model.safetensors")]
    assert len(tries) == 2 and tries[1].range == f"bytes={cut}-"  # the retry inside the run resumed too

    hub.truncate.clear()
    start = len(hub.log)
    res = fetch("hf://org/tiny", into, {"HF_ENDPOINT": hub.endpoint})
    assert res.returncode == 0, res.stderr
    rerun = [r for r in hub.log[start:] if "/resolve/" in r.path]
    done_before = {r.path for r in hub.log[first:start] if "/resolve/" in r.path} - {tries[0].path}
    assert not done_before & {r.path for r in rerun}  # verified files are kept, not fetched again
    resumed = [(r.range, r.body_bytes) for r in rerun if r.path.endswith("/model.safetensors")]
    assert resumed == [(f"bytes={cut}-", size - cut)]
    total = sum(p.stat().st_size for p in tiny_model.iterdir())
    assert sum(r.body_bytes for r in rerun) == events(res)[-1]["downloaded"] < total - cut
    assert same_files(tiny_model, into)


@pytest.mark.parametrize(
    "scheme, source, key, kind",
    [
        ("hf", "hf://org/tiny", "model.safetensors", "sha256"),
        ("s3", "s3://models/llama/tiny", "models/llama/tiny/model.safetensors", "s3-multipart"),
        ("s3", "s3://models/llama/tiny", "models/llama/tiny/config.json", "md5"),
    ],
)
def test_checksum_mismatch_is_permanent_and_unpublished(
    scheme, source, key, kind, request, tiny_model, tmp_path
):
    server = request.getfixturevalue("clean_hub" if scheme == "hf" else "s3")
    env = {"HF_ENDPOINT": server.endpoint} if scheme == "hf" else request.getfixturevalue("s3_env")
    into, name = tmp_path / "tiny", key.rpartition("/")[2]
    server.corrupt.add(key)
    try:
        res = fetch(source, into, {**env, "SPYRE_FETCH_RETRIES": "1"})
    finally:
        server.corrupt.clear()
    assert res.returncode == 2, res.stderr  # issue 37: permanent (after one retry when the tries allow)
    assert f"{source}: file {name}: checksum mismatch ({kind} expected" in last_line(res)
    assert not into.exists() and not (tmp_path / "tiny.partial" / name).exists()
    assert fetch(source, into, env).returncode == 0
    assert same_files(tiny_model, into)


@pytest.fixture
def small_volume(tmp_path):
    """A real 256 KiB tmpfs (the test runs as root, as make test and CI do here)."""
    mount = tmp_path / "vol"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_full_volume(clean_hub, small_volume):
    res = fetch("hf://org/tiny", small_volume / "tiny", {"HF_ENDPOINT": clean_hub.endpoint})
    assert res.returncode == 2, res.stderr
    assert last_line(res).startswith(f"not enough space on {small_volume}: need ")
    assert not (small_volume / "tiny").exists()
    assert not any(p.is_file() for p in small_volume.rglob("*"))  # nothing was fetched at all

    # the free-space reading lies (another writer filled the volume after the check): the real ENOSPC
    env = {"HF_ENDPOINT": clean_hub.endpoint}
    with pytest.raises(FetchError, match=r"not enough space on .*ENOSPC writing model.safetensors") as err:
        fetch_model("hf://org/tiny", small_volume / "tiny", env=env, free=lambda path: 1 << 40)
    assert err.value.exit_code == 2 and not (small_volume / "tiny").exists()


@pytest.mark.parametrize("tries", ["0", "three"])
def test_bad_retries_setting(tries, tmp_path):
    with pytest.raises(FetchError, match=f"SPYRE_FETCH_RETRIES='{tries}' must be a positive number") as err:
        fetch_model("hf://org/tiny", tmp_path / "m", env={"SPYRE_FETCH_RETRIES": tries})
    assert err.value.exit_code == 2 and not (tmp_path / "m").exists()


def test_progress_cadence():
    """At most one line per interval while bytes arrive, one at the start and one when asked at the end."""
    now = [0.0]
    out = io.StringIO()
    progress = Progress(1000, 100, out=out, interval=1.0, clock=lambda: now[0])
    for _ in range(9):
        now[0] += 0.3
        progress.advance(100)
    progress.rewind(100)  # a deleted mismatching file takes its bytes back
    progress.report()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [e["done"] for e in lines] == [100, 500, 900, 900]  # at 0, 1.2 and 2.4 s, then the end
    assert all(e == {"event": "progress", "done": e["done"], "total": 1000} for e in lines)
    assert progress.downloaded == 900


def test_space_check_counts_bytes_still_to_fetch(tmp_path):
    check_space(tmp_path, 1000, free=lambda path: 1000)
    with pytest.raises(FetchError, match=r"need 1001 bytes, have 1000 bytes") as err:
        check_space(tmp_path, 1001, free=lambda path: 1000)
    assert err.value.exit_code == 2


@pytest.mark.parametrize(
    "manifest, message",
    [
        (None, "exists and has no valid .spyre-model.json"),
        ({"source": "hf://org/other", "files": []}, "holds 'hf://org/other', not 'hf://org/tiny'"),
    ],
)
def test_never_overwrites_a_folder_it_did_not_publish(manifest, message, tmp_path):
    into = tmp_path / "tiny"
    into.mkdir()
    if manifest is not None:
        (into / ".spyre-model.json").write_text(json.dumps(manifest))
    with pytest.raises(FetchError, match=re.escape(message)) as err:  # before any request: no endpoint
        fetch_model("hf://org/tiny", into, env={"HF_ENDPOINT": "http://127.0.0.1:9"})
    assert err.value.exit_code == 2


def test_one_loader_per_folder(clean_hub, tmp_path):
    into = tmp_path / "tiny"
    holder = Staging(into, "hf://org/tiny")
    holder.prepare(Listing(revision="main", commit=None))
    try:
        res = fetch("hf://org/tiny", into, {"HF_ENDPOINT": clean_hub.endpoint})
        assert (
            res.returncode == 1
            and last_line(res) == f"hf://org/tiny: another loader is fetching into {into}.partial"
        )
    finally:
        holder.unlock()
    assert fetch("hf://org/tiny", into, {"HF_ENDPOINT": clean_hub.endpoint}).returncode == 0


@pytest.mark.cluster
def test_progress_annotation_on_own_pod(cluster, kube, clean_hub, tmp_path):
    from kubernetes import client

    from tests.conftest import wait_for

    core = client.CoreV1Api(kube)
    ns = "fetch-model-progress"
    core.create_namespace({"metadata": {"name": ns}})
    try:
        wait_for(
            lambda: core.read_namespaced_service_account("default", ns).secrets,
            what="the default service account's token (pods need it in 1.20)",
        )
        spec = {"containers": [{"name": "loader", "image": "quay.io/spyre-serve/runtime:0.1.0"}]}
        core.create_namespaced_pod(ns, {"metadata": {"name": "loader"}, "spec": spec})
        pod_env = {
            "HF_ENDPOINT": clean_hub.endpoint,
            "KUBECONFIG": str(cluster.kubeconfig),
            "POD_NAMESPACE": ns,
        }
        res = fetch("hf://org/tiny", tmp_path / "tiny", {**pod_env, "POD_NAME": "loader"})
        assert res.returncode == 0, res.stderr
        total = events(res)[-1]["bytes"]
        annotations = core.read_namespaced_pod("loader", ns).metadata.annotations
        assert annotations["spyre-serve.io/model-progress"] == f"{total}/{total}"

        res = fetch("hf://org/tiny", tmp_path / "other", {**pod_env, "POD_NAME": "not-a-pod"})
        assert res.returncode == 0, res.stderr  # a failing patch is logged once, never fatal
        assert res.stderr.count("cannot annotate pod fetch-model-progress/not-a-pod") == 1
    finally:
        core.delete_namespace(ns)
