"""Model sources end to end (issue 25), on one control plane for the module: the operator installed by its
chart and run by the local pod runner, which runs the loader Jobs' `spyre-runtime fetch-model` and the
serving pods for real. `s3://` from a real S3 server on 127.0.0.1 (moto, credentials from a Secret) and
`hf://` from a local hub (the model's endpoint) become Ready from an empty cache; a second replica starts from
the cache (no loader runs again, no object is read again; a loader run again on a complete folder says
`cached:` and reads nothing); `oci://` serves as a modelcar (the pod runner backs the image with a folder).
Bad credentials (S3 and hub), a missing object, a truncated transfer and a full volume (a 64 KiB tmpfs as the
claim) each end Stalled with the loader's last words, an Event, no pod and nothing published. Tiny models,
eager backend, one card."""

from __future__ import annotations

import contextlib
import subprocess

import openai
import pytest
from kubernetes import client
from spyre_operator.spec.parse import parse_spec
from spyre_runtime.testing.models import write_tiny_model

from tests.cluster.controlplane import free_port
from tests.cluster.hfhub import HfHub
from tests.cluster.s3server import S3Server
from tests.cluster.stack import LocalStack
from tests.hf_greedy import hf_greedy_text

pytestmark = pytest.mark.cluster

NS = "sources"
IMAGE = "registry.example.com/models/tiny:1"
CLOSED = f"http://127.0.0.1:{free_port()}"  # a port nothing listens on: connections are refused
SHAPES = [{"promptLength": 64, "newTokens": 4, "batchSize": 1}]


def spec(source: str, replicas: int = 1, **model) -> dict:
    return {
        "model": {"source": source, "servedModelName": "tiny", **model},
        "cards": 1,
        "replicas": replicas,
        "backend": "eager",
        "batching": {"mode": "static", "shapes": SHAPES},
    }


def manifest(name: str, body: dict) -> dict:
    return {
        "apiVersion": "spyre-serve.io/v1alpha1",
        "kind": "SpyreModel",
        "metadata": {"name": name},
        "spec": body,
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The stack, an S3 server and a hub, each holding the same tiny model; a Secret of each's credentials."""
    root = tmp_path_factory.mktemp("sources")
    tiny = write_tiny_model(root / "tiny")
    stack = LocalStack(root / "stack")
    s3 = S3Server(root / "s3")
    hub = HfHub(root / "hub")
    try:
        stack.start({"models": {"loaderRetries": 1}})
        stack.create_namespace(NS)
        stack.runner.image_folders[IMAGE] = tiny
        # its USER: the modelcar runs under the pod's runAsNonRoot, which a root image (no USER line) fails
        stack.runner.image_users[IMAGE] = "65532"
        s3.start()
        s3.put_folder("models", "tiny", tiny)
        hub.start()
        hub.add_model("org/tiny", tiny)
        hub.add_model("org/cut", tiny)
        hub.token = "hf_right"
        core = client.CoreV1Api(stack.kube)
        secrets = {
            "s3-creds": s3.credentials,
            "s3-wrong": {**s3.credentials, "AWS_SECRET_ACCESS_KEY": "not-the-secret"},
            "hub-token": {"HF_TOKEN": "hf_right"},
            "hub-wrong": {"HF_TOKEN": "hf_wrong"},
        }
        for name, data in secrets.items():
            core.create_namespaced_secret(NS, {"metadata": {"name": name}, "stringData": data})
        stack.tiny_bytes = sum(f.stat().st_size for f in tiny.rglob("*") if f.is_file())
        stack.answer = hf_greedy_text(tiny, "Paris is", 4)  # what every source's model must say
        yield stack, s3, hub
    finally:
        hub.stop()
        s3.stop()
        stack.stop()


def ask(stack: LocalStack, name: str) -> list[str]:
    """Every ready endpoint of the model answers the official client."""
    answers = []
    for ip in stack.endpoints(NS, name):
        c = openai.OpenAI(base_url=f"http://{ip}:8000/v1", api_key="unused", max_retries=0, timeout=30)
        answers.append(c.completions.create(model="tiny", prompt="Paris is", max_tokens=4, temperature=0))
    return [a.choices[0].text for a in answers]


def ready(stack: LocalStack, name: str, replicas: int, timeout: float = 240) -> dict:
    stack.wait(
        lambda: stack.is_ready(NS, name, replicas), timeout, f"{name} Ready", lambda: stack.diagnose(NS, name)
    )
    stack.wait(lambda: len(stack.endpoints(NS, name)) == replicas, 30, f"{replicas} endpoints of {name}")
    return stack.model(NS, name)


def condition(stack: LocalStack, name: str, type_: str) -> dict:
    conditions = (stack.model(NS, name).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == type_), {})


def loader_jobs(stack: LocalStack, name: str) -> list:
    batch = client.BatchV1Api(stack.kube)
    return batch.list_namespaced_job(NS, label_selector=f"spyre-serve.io/fetch-for={name}").items


def cache_dir(stack: LocalStack, name: str, body: dict):
    """Where the pod runner keeps the model's cache folder: models/<fetch key> of its graph-cache claim."""
    key = parse_spec(name, body).source.fetch_key
    return stack.model_claim_dir(NS, f"{name}-graph-cache") / "models" / key


def loader_logs(stack: LocalStack, name: str) -> list[str]:
    return [
        rp.log.read_text(errors="replace")
        for rp in stack.runner.pods.values()
        if rp.namespace == NS and rp.name.startswith(f"{name}-fetch-") and rp.log and rp.log.exists()
    ]


def explain(stack: LocalStack, name: str) -> str:
    """The model's conditions and pods' last words, and the operator's own last log lines."""
    operator = [rp for rp in stack.runner.pods.values() if rp.namespace == "spyre-system" and rp.log]
    tails = [rp.log.read_text(errors="replace").splitlines()[-20:] for rp in operator if rp.log.exists()]
    return stack.diagnose(NS, name) + "\n" + "\n".join(line for tail in tails for line in tail)


def loader_running(stack: LocalStack, name: str) -> bool:
    return any(rp.name.startswith(f"{name}-fetch-") for rp in list(stack.runner.pods.values()))


def test_s3_model_from_an_empty_cache_then_a_second_replica_reads_nothing(world):
    stack, s3, _ = world
    body = spec("s3://models/tiny", secretRef="s3-late", endpoint=s3.endpoint)
    assert not cache_dir(stack, "from-s3", body).exists()
    stack.apply_model(NS, manifest("from-s3", body))
    # its Secret does not exist yet: the loader pod waits (CreateContainerConfigError), the model says so
    waiting = stack.wait(
        lambda: (
            (c := condition(stack, "from-s3", "ModelCached")).get("reason") == "Downloading"
            and "CreateContainerConfigError" in c["message"]
            and c
        ),
        60,
        "ModelCached Downloading, its loader pod waiting for the Secret",
        lambda: explain(stack, "from-s3"),
    )
    assert waiting["status"] == "False" and condition(stack, "from-s3", "Reconciling")["status"] == "True"
    assert condition(stack, "from-s3", "Progressing")["reason"] == "WaitingForModel"
    assert (
        client.CoreV1Api(stack.kube)
        .list_namespaced_pod(NS, label_selector="spyre-serve.io/model=from-s3")
        .items
        == []
    )
    secret = {"metadata": {"name": "s3-late"}, "stringData": s3.credentials}
    client.CoreV1Api(stack.kube).create_namespaced_secret(NS, secret)
    ready(stack, "from-s3", 1)
    cached = condition(stack, "from-s3", "ModelCached")
    assert cached["status"] == "True" and cached["reason"] == "Cached"
    assert f"{stack.tiny_bytes} bytes" in cached["message"]  # the loader's progress annotation, read back
    assert (cache_dir(stack, "from-s3", body) / "config.json").exists()
    first = ask(stack, "from-s3")
    assert first == [stack.answer]
    gets = len(s3.object_gets("models"))
    assert gets >= 3  # config, weights, tokenizer

    stack.apply_model(NS, manifest("from-s3", {**body, "replicas": 2}))
    ready(stack, "from-s3", 2)
    assert len(s3.object_gets("models")) == gets  # the second replica mounted the cache: nothing read
    assert len(loader_jobs(stack, "from-s3")) == 1
    assert ask(stack, "from-s3") == [stack.answer] * 2

    # a loader run again on the complete folder says so and reads nothing
    (job,) = loader_jobs(stack, "from-s3")
    client.BatchV1Api(stack.kube).delete_namespaced_job(
        job.metadata.name, NS, propagation_policy="Background"
    )
    stack.wait(
        lambda: any("cached: " in log for log in loader_logs(stack, "from-s3")),
        90,
        "a second loader run that finds the folder cached",
    )
    stack.wait(lambda: stack.is_ready(NS, "from-s3", 2), 60, "from-s3 Ready again")
    assert len(s3.object_gets("models")) == gets


def test_hf_model_with_a_token_from_an_empty_cache(world):
    stack, _, hub = world
    body = spec("hf://org/tiny@main", secretRef="hub-token", endpoint=hub.endpoint)
    stack.apply_model(NS, manifest("from-hub", body))
    ready(stack, "from-hub", 1)
    assert condition(stack, "from-hub", "ModelCached")["reason"] == "Cached"
    assert any(r.path.startswith("/org/tiny/resolve/") for r in hub.file_gets())
    pod = client.CoreV1Api(stack.kube).list_namespaced_pod(NS, label_selector="spyre-serve.io/model=from-hub")
    (mount,) = [m for m in pod.items[0].spec.containers[0].volume_mounts if m.mount_path == "/models"]
    assert mount.read_only and mount.sub_path == f"models/{parse_spec('from-hub', body).source.fetch_key}"
    assert ask(stack, "from-hub") == [stack.answer]


def test_oci_model_serves_as_a_modelcar(world):
    stack, _, _ = world
    stack.apply_model(NS, manifest("from-image", spec(f"oci://{IMAGE}")))
    ready(stack, "from-image", 1)
    pod = client.CoreV1Api(stack.kube).list_namespaced_pod(
        NS, label_selector="spyre-serve.io/model=from-image"
    )
    (init,) = pod.items[0].spec.init_containers
    assert init.image == IMAGE and init.command[:2] == ["cp", "-R"]
    assert condition(stack, "from-image", "ModelCached") == {}  # nothing downloaded for an image
    assert ask(stack, "from-image") == [stack.answer]


FAILURES = [
    (
        "bad-s3-key",
        "s3",
        {"source": "s3://models/tiny", "secretRef": "s3-wrong"},
        "access denied (SignatureDoesNotMatch)",
    ),
    ("no-such-object", "s3", {"source": "s3://models/nothing-here", "secretRef": "s3-creds"}, "no objects"),
    ("bad-hub-token", "hf", {"source": "hf://org/tiny", "secretRef": "hub-wrong"}, "check HF_TOKEN"),
    # transient (exit 1): retried by the Job (resuming the partial file), then failed for good
    ("cut-transfer", "hf", {"source": "hf://org/cut", "secretRef": "hub-token"}, "truncated transfer"),
    # the claim is a 64 KiB tmpfs (mounted where the pod runner keeps it): smaller than the model
    ("full-volume", "s3", {"source": "s3://models/tiny", "secretRef": "s3-creds"}, "not enough space on"),
    # nothing listens at the endpoint: permanent after the loader's one retry, and the words say where else
    # a model can come from (the hint is the loader's; the condition adds the operator's own)
    (
        "no-hub",
        "hf",
        {"source": "hf://org/tiny", "secretRef": "hub-token", "endpoint": CLOSED},
        f"hf://org/tiny: cannot reach {CLOSED} (connection refused); set spec.model.endpoint",
    ),
    (
        "no-store",
        "s3",
        {"source": "s3://models/tiny", "secretRef": "s3-creds", "endpoint": CLOSED},
        f"s3://models/tiny: cannot reach {CLOSED} (connection refused); set spec.model.endpoint",
    ),
]
UNREACHABLE_HINTS = ("spec.model.endpoint", "pvc://", "oci://")


@contextlib.contextmanager
def small_volume(path, size: str = "64k"):
    """A real full volume: a tmpfs of `size` at `path` (mounting needs root, as `make test` runs here)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    assert mounted.returncode == 0, f"a full volume needs a tmpfs mount (root): {mounted.stderr.decode()}"
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.mark.parametrize(("name", "kind", "model", "words"), FAILURES, ids=[f[0] for f in FAILURES])
def test_failed_download_is_stalled_with_the_loaders_words_and_nothing_published(
    world, name, kind, model, words
):
    stack, s3, hub = world
    model = dict(model)
    endpoint = model.pop("endpoint", s3.endpoint if kind == "s3" else hub.endpoint)
    body = spec(model.pop("source"), endpoint=endpoint, **model)
    seen: list[str] = []  # ModelCached's messages on the way

    def is_stalled():
        seen.append(condition(stack, name, "ModelCached").get("message", ""))
        return (c := condition(stack, name, "Stalled")).get("status") == "True" and c

    if name == "cut-transfer":
        hub.truncate["model.safetensors"] = 1000
    with contextlib.ExitStack() as scope:
        if name == "full-volume":
            scope.enter_context(small_volume(stack.model_claim_dir(NS, f"{name}-graph-cache")))
        try:
            stack.apply_model(NS, manifest(name, body))
            stalled = stack.wait(is_stalled, 150, f"{name} Stalled", lambda: stack.diagnose(NS, name))
        finally:
            hub.truncate.clear()
        assert stalled["reason"] == "DownloadFailed" and words in stalled["message"], stalled
        cached = condition(stack, name, "ModelCached")
        assert cached["status"] == "False" and cached["reason"] == "DownloadFailed"
        assert condition(stack, name, "Ready")["status"] == "False"
        assert not cache_dir(stack, name, body).exists()  # nothing half-published
        if name == "cut-transfer":  # the Job tried again (backoffLimit 1), resuming, then failed for good
            assert sum(n.startswith(f"{name}-fetch-") for _, n, _ in stack.runner.admitted) == 2
            # and while it waited to, the condition said why the first attempt failed (not "starting")
            retrying = "its last attempt failed: exit code 1: hf://org/cut"
            assert any(retrying in m and "truncated transfer" in m and "retrying" in m for m in seen), seen
        if name.startswith("no-"):
            assert all(hint in stalled["message"] for hint in UNREACHABLE_HINTS), stalled
        core = client.CoreV1Api(stack.kube)
        assert core.list_namespaced_pod(NS, label_selector=f"spyre-serve.io/model={name}").items == []
        events = core.list_namespaced_event(NS, field_selector=f"involvedObject.name={name}").items
        assert any(e.reason == "DownloadFailed" for e in events)
        # gone with its loader Job (a cluster without pod failure policies would retry it) before the volume
        stack.kubectl("delete", "spyremodel", name, "-n", NS, "--wait=false")
        stack.wait(lambda: not loader_running(stack, name), 90, f"{name}'s loader pods gone")


def test_image_volume_mode_on_a_cluster_without_image_volumes_says_so(world):
    """Last in the module (it upgrades the operator): SPYRE_OPERATOR_OCI_MODE=image-volume on 1.20, whose API
    server keeps the pod but drops its `image` volume source (the volume becomes an empty emptyDir): the
    operator sees it in its dry run, and the model is InvalidSpec naming the setting, with no pod."""
    stack, _, _ = world
    stack.install_operator({"models": {"loaderRetries": 1, "ociMode": "image-volume"}}, upgrade=True)
    stack.apply_model(NS, manifest("as-volume", spec(f"oci://{IMAGE}")))
    stalled = stack.wait(
        lambda: (c := condition(stack, "as-volume", "Stalled")).get("status") == "True" and c,
        90,
        "as-volume Stalled",
        lambda: explain(stack, "as-volume"),
    )
    assert stalled["reason"] == "InvalidSpec", stalled
    assert stalled["message"].startswith(
        f"spec.model.source: oci://{IMAGE}: this cluster does not serve image"
    )
    assert "SPYRE_OPERATOR_OCI_MODE=modelcar" in stalled["message"]
    pods = client.CoreV1Api(stack.kube).list_namespaced_pod(
        NS, label_selector="spyre-serve.io/model=as-volume"
    )
    assert pods.items == []
