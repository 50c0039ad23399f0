"""The loader Job behind a proxy (issue 37): the model's proxy and CA settings reach the loader, and a CA
bundle from a ConfigMap is mounted where its clients (requests, botocore, httpx) read it."""

import kubernetes_validate
import pytest
from spyre_operator.kinds.loader_job import CA_FILE, build_loader_job
from spyre_operator.settings import OperatorSettings
from spyre_operator.spec.model_spec import InvalidSpec
from spyre_operator.spec.parse import parse_spec

from tests.operator.spec.test_model_source import BASE, MODEL, env_of, volume

PROXY_ENV = [
    {"name": "HTTPS_PROXY", "value": "http://proxy.corp:3128"},
    {"name": "no_proxy", "value": "10.0.0.0/8,.svc"},
    {"name": "AWS_CA_BUNDLE", "value": "/models-ca/own.pem"},  # the user's own path wins
    {"name": "SENDNN_INFERENCE_DTYPE", "value": "float16"},  # the runtime's, not the loader's
    {"name": "SPYRE_FETCH_INCLUDE", "value": "original/params.json"},  # the loader's extra files
]


def loader_container(source: str, model: dict | None = None, env: list | None = None) -> tuple[dict, dict]:
    spec = parse_spec("tiny", {**BASE, "model": {"source": source, **(model or {})}, "env": env or []})
    job = build_loader_job(MODEL, spec, OperatorSettings(), spec.source.fetch_key)
    pod = job["spec"]["template"]["spec"]
    return job, pod


@pytest.mark.parametrize("source", ["hf://org/tiny", "s3://bucket/tiny"])
def test_the_models_proxy_and_ca_settings_reach_the_loader(source):
    ca = {"caBundle": {"configMapName": "corp-ca", "key": "bundle.pem"}}
    job, pod = loader_container(source, {"secretRef": "creds", **ca}, PROXY_ENV)
    (container,) = pod["containers"]
    env = env_of(container)
    assert env["HTTPS_PROXY"]["value"] == "http://proxy.corp:3128"
    assert env["no_proxy"]["value"] == "10.0.0.0/8,.svc"
    assert env["AWS_CA_BUNDLE"]["value"] == "/models-ca/own.pem"
    assert env["REQUESTS_CA_BUNDLE"]["value"] == env["SSL_CERT_FILE"]["value"] == CA_FILE
    assert "SENDNN_INFERENCE_DTYPE" not in env
    assert env["SPYRE_FETCH_INCLUDE"]["value"] == "original/params.json"
    assert len([e for e in container["env"] if e["name"] == "AWS_CA_BUNDLE"]) == 1
    # the ConfigMap's key, mounted read-only as the file the variables name
    assert volume(pod, "ca-bundle")["configMap"] == {
        "name": "corp-ca",
        "items": [{"key": "bundle.pem", "path": CA_FILE.rsplit("/", 1)[1]}],
    }
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "ca-bundle"]
    assert mount["readOnly"] and f"{mount['mountPath']}/ca.crt" == CA_FILE
    job["metadata"].setdefault("name", "tiny-x")
    kubernetes_validate.validate(job, kubernetes_validate.latest_version(), strict=True)


def test_without_them_the_loader_job_is_as_before():
    _, pod = loader_container("hf://org/tiny", {"caBundle": {"configMapName": "corp-ca"}})
    assert volume(pod, "ca-bundle")["configMap"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    _, plain = loader_container("hf://org/tiny", env=[{"name": "TZ", "value": "UTC"}])
    names = {e["name"] for e in plain["containers"][0]["env"]}
    assert names == {"HOME", "POD_NAME", "POD_NAMESPACE"}
    assert {v["name"] for v in plain["volumes"]} == {"graph-cache", "tmp"}


@pytest.mark.parametrize(
    ("source", "ca_bundle", "field", "words"),
    [
        ("pvc://models/tiny", {"configMapName": "corp-ca"}, "model.caBundle", "applies to hf:// and s3://"),
        ("hf://org/tiny", {"configMapName": "Corp CA"}, "model.caBundle.configMapName", "a DNS name"),
        (
            "hf://org/tiny",
            {"configMapName": "corp-ca", "key": "a/b"},
            "model.caBundle.key",
            "a ConfigMap key",
        ),
        ("hf://org/tiny", {"name": "corp-ca"}, "model.caBundle", "configMapName and key"),
    ],
)
def test_a_bad_ca_bundle_is_invalid_spec_naming_the_field(source, ca_bundle, field, words):
    with pytest.raises(InvalidSpec) as err:
        loader_container(source, {"caBundle": ca_bundle})
    assert str(err.value).startswith(f"spec.{field}: ") and words in str(err.value)


class CountingKube:
    """The loader step's reads and writes on a succeeded loader Job of the model's fetch key."""

    def __init__(self, job: dict) -> None:
        self.job, self.calls = job, []

    def list(self, kind, namespace, selector):
        self.calls.append(f"list {kind}")
        return [self.job] if kind == "Job" else []

    def create_unless_exists(self, body):
        self.calls.append(f"create {body['kind']}")
        return True

    def delete(self, kind, name, namespace):
        self.calls.append(f"delete {kind}")


class NoEvents:
    def post(self, *args, **kwargs):
        pass


def test_a_cached_model_lists_no_loader_pods_at_every_pass():
    """Issue 37: a loader Job that succeeded stays so; its pods are read once (for the bytes cached), not
    at every pass of a model that is served. A new Job of the key (another uid) is read again."""
    from spyre_operator.io.work import Pass
    from spyre_operator.kinds.loader_job import LoaderJobStep

    spec = parse_spec("tiny", {**BASE, "model": {"source": "hf://org/tiny"}})
    job = build_loader_job(MODEL, spec, OperatorSettings(), spec.source.fetch_key)
    job["metadata"]["uid"], job["status"] = "job-1", {"succeeded": 1}
    kube = CountingKube(job)
    step = LoaderJobStep(OperatorSettings(), kube, NoEvents())
    first = step.ensure(MODEL, spec, Pass())
    assert first.is_ready and kube.calls.count("list Pod") == 1
    kube.calls.clear()
    assert step.ensure(MODEL, spec, Pass()) == first and kube.calls == ["list Job"]
    job["metadata"]["uid"] = "job-2"  # deleted and made again: read afresh
    assert step.ensure(MODEL, spec, Pass()).is_ready and kube.calls.count("list Pod") == 1
