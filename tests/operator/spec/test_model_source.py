"""Model sources without a cluster (issue 25): the URI grammar of every scheme, what each one renders into a
serving pod and the compile Job (claim, hostPath, image volume or modelcar, the model cache's folder), the
loader Job and its access, what the operator reads off a loader Job, and the ModelCached condition."""

import pytest
from spyre_contract.source_uri import SourceError, parse_source_uri
from spyre_operator.admission import check_spec
from spyre_operator.kinds.compile_job import build_compile_job, cache_key
from spyre_operator.kinds.loader_job import (
    ModelCacheState,
    build_loader_access,
    build_loader_job,
    loader_job_name,
    observe_loader,
)
from spyre_operator.kinds.pods.plan import PodView
from spyre_operator.kinds.pods.template import pod_template, template_hash
from spyre_operator.settings import PROGRESS_ANNOTATION, OperatorSettings, SettingsError, load_settings
from spyre_operator.spec.model_source import image_pull_policy
from spyre_operator.spec.model_spec import InvalidSpec
from spyre_operator.spec.parse import parse_spec
from spyre_operator.status.conditions import compute_status

DIGEST = "sha256:" + "ab" * 32
BASE = {
    "backend": "eager",
    "batching": {"mode": "static", "shapes": [{"promptLength": 64, "newTokens": 8, "batchSize": 1}]},
}
MODEL = {"metadata": {"name": "tiny", "namespace": "ml", "uid": "u-1", "generation": 1}}


def spec_of(source: str, **model):
    return parse_spec("tiny", {**BASE, "model": {"source": source, **model}})


@pytest.mark.parametrize(
    ("uri", "fields"),
    [
        ("pvc://models/granite/3b", {"scheme": "pvc", "claim": "models", "path": "granite/3b"}),
        ("file:///var/models/granite", {"scheme": "file", "path": "/var/models/granite"}),
        ("oci://quay.io/org/granite:1.0", {"scheme": "oci", "image": "quay.io/org/granite:1.0"}),
        (
            f"oci://localhost:5000/granite@{DIGEST}",
            {"scheme": "oci", "image": f"localhost:5000/granite@{DIGEST}"},
        ),
        (
            "hf://ibm-granite/granite-3.0-2b-instruct",
            {"repo": "ibm-granite/granite-3.0-2b-instruct", "revision": "main"},  # the Hub's default
        ),
        ("hf://org/model@refs/pr/1", {"scheme": "hf", "repo": "org/model", "revision": "refs/pr/1"}),
        (
            "s3://models.team-a/granite/3b/",
            {"scheme": "s3", "bucket": "models.team-a", "prefix": "granite/3b"},
        ),
    ],
)
def test_every_scheme_parses(uri, fields):
    source = parse_source_uri(uri)
    assert {k: getattr(source, k) for k in fields} == fields
    assert source.is_downloaded == (source.scheme in ("hf", "s3"))


@pytest.mark.parametrize(
    ("uri", "words"),
    [
        ("https://huggingface.co/org/model", "must be one of pvc://CLAIM/PATH"),
        ("pvc://Models/x", "is not pvc://CLAIM/PATH"),
        ("file://relative", "is not file:///PATH"),
        ("oci://quay.io/Org/model", "repository name must be lowercase"),
        ("oci://granite:1", "names no registry"),
        ("oci://quay.io/org/model@sha256:abc", "invalid reference format"),
        ("hf://org", "is not hf://ORG/NAME[@REVISION]"),
        ("hf://org/name@", "is not hf://ORG/NAME[@REVISION]"),
        ("hf://org/a..b", "has no '--' or '..'"),
        ("s3://bucket", "is not s3://BUCKET/PREFIX"),
        ("s3://bucket//", "is not s3://BUCKET/PREFIX"),
        ("s3://ab/model", "is not s3://BUCKET/PREFIX"),  # bucket names have 3 characters at least
    ],
)
def test_malformed_sources_say_what_is_wrong(uri, words):
    with pytest.raises(SourceError) as err:
        parse_source_uri(uri)
    assert words in str(err.value)
    with pytest.raises(InvalidSpec) as err:
        spec_of(uri)
    assert str(err.value).startswith("spec.model.source: ") and words in str(err.value)


def test_secret_ref_and_endpoint_only_where_downloaded():
    spec = spec_of("s3://bucket/tiny", secretRef="creds", endpoint="http://127.0.0.1:9000")
    assert (spec.source.secret_ref, spec.source.endpoint) == ("creds", "http://127.0.0.1:9000")
    for source in ("pvc://models/tiny", "oci://quay.io/org/tiny:1"):
        with pytest.raises(InvalidSpec, match=r"spec\.model\.secretRef: applies to hf:// and s3://"):
            spec_of(source, secretRef="creds")
        with pytest.raises(InvalidSpec, match=r"spec\.model\.endpoint: applies to hf:// and s3://"):
            spec_of(source, endpoint="https://hub")


@pytest.mark.parametrize(
    ("reference", "policy"),
    [
        ("quay.io/o/m", "Always"),
        ("quay.io/o/m:latest", "Always"),
        ("localhost:5000/m", "Always"),
        ("localhost:5000/m:1", "IfNotPresent"),
        (f"quay.io/o/m@{DIGEST}", "IfNotPresent"),
    ],
)
def test_image_pull_policy_is_the_kubelets_default(reference, policy):
    assert image_pull_policy(reference) == policy


def volume(pod_spec, name):
    return next(v for v in pod_spec["volumes"] if v["name"] == name)


def mount_at(container, path):
    return next(m for m in container["volumeMounts"] if m["mountPath"] == path)


def test_oci_renders_both_ways_read_only_at_the_model_path():
    spec = spec_of("oci://quay.io/org/tiny:1")
    car = pod_template("tiny", spec, OperatorSettings(oci_mode="modelcar"))
    (init,) = car["initContainers"]
    assert init["image"] == "quay.io/org/tiny:1" and init["command"] == [
        "cp",
        "-R",
        "/models/.",
        "/mnt/models/",
    ]
    assert volume(car, "model") == {"name": "model", "emptyDir": {}}
    assert init["volumeMounts"] == [{"name": "model", "mountPath": "/mnt/models"}]
    assert mount_at(car["containers"][0], "/models") == {
        "name": "model",
        "mountPath": "/models",
        "readOnly": True,
    }
    image = pod_template("tiny", spec, OperatorSettings(oci_mode="image-volume"))
    assert "initContainers" not in image
    assert volume(image, "model") == {
        "name": "model",
        "image": {"reference": "quay.io/org/tiny:1", "pullPolicy": "IfNotPresent"},
    }
    assert mount_at(image["containers"][0], "/models") == {
        "name": "model",
        "mountPath": "/models",
        "subPath": "models",
        "readOnly": True,
    }
    assert car["containers"][0]["args"][:2] == image["containers"][0]["args"][:2] == ["serve", "/models"]
    assert template_hash(car) != template_hash(image)
    # the compile Job gets the model the same way
    job = build_compile_job(MODEL, spec, OperatorSettings(), cache_key(spec, OperatorSettings()))
    assert job["spec"]["template"]["spec"]["initContainers"][0]["image"] == "quay.io/org/tiny:1"


def test_downloaded_models_mount_their_cache_folder_read_only():
    spec = spec_of("hf://org/tiny@main")
    pod = pod_template("tiny", spec, OperatorSettings())
    runtime = pod["containers"][0]
    assert mount_at(runtime, "/models") == {
        "name": "graph-cache",
        "mountPath": "/models",
        "subPath": f"models/{spec.source.fetch_key}",
        "readOnly": True,
    }
    assert mount_at(runtime, "/cache")["name"] == "graph-cache" and "initContainers" not in pod
    assert runtime["args"][1] == "/models"
    # one folder per source and endpoint: a new revision or another endpoint is another download
    keys = {
        s.source.fetch_key
        for s in (spec, spec_of("hf://org/tiny@v2"), spec_of("hf://org/tiny@main", endpoint="http://h"))
    }
    assert len(keys) == 3
    with pytest.raises(InvalidSpec, match=r"spec\.graphCache\.enabled: hf:// models are downloaded"):
        parse_spec("tiny", {**BASE, "model": {"source": "hf://org/tiny"}, "graphCache": {"enabled": False}})


def test_host_path_models_only_when_an_admin_allows_them():
    raw = {**BASE, "model": {"source": "file:///var/models/tiny"}}
    with pytest.raises(InvalidSpec, match="SPYRE_OPERATOR_ALLOW_HOST_PATH=1"):
        check_spec("tiny", raw, OperatorSettings())
    spec = check_spec("tiny", raw, OperatorSettings(allow_host_path=True))
    pod = pod_template("tiny", spec, OperatorSettings(allow_host_path=True))
    assert volume(pod, "model") == {
        "name": "model",
        "hostPath": {"path": "/var/models/tiny", "type": "Directory"},
    }
    assert mount_at(pod["containers"][0], "/var/models/tiny")["readOnly"] is True


def test_pvc_pods_are_unchanged():
    pod = pod_template("tiny", spec_of("pvc://models/tiny"), OperatorSettings())
    assert volume(pod, "model") == {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
    }
    assert pod["containers"][0]["args"][1] == "/models/tiny" and "initContainers" not in pod


def env_of(container):
    return {e["name"]: e for e in container["env"]}


@pytest.mark.parametrize(
    ("source", "keys"),
    [
        ("hf://org/tiny", {"HF_TOKEN": None}),
        (
            "s3://bucket/tiny",
            {
                "AWS_ACCESS_KEY_ID": None,
                "AWS_SECRET_ACCESS_KEY": None,
                "AWS_SESSION_TOKEN": True,
                "AWS_REGION": True,
            },
        ),
    ],
)
def test_loader_job(source, keys):
    spec = spec_of(source, secretRef="creds", endpoint="http://127.0.0.1:9000")
    settings = OperatorSettings(loader_retries=4)
    job = build_loader_job(MODEL, spec, settings, spec.source.fetch_key)
    assert job["metadata"]["name"] == loader_job_name("tiny", spec.source.fetch_key)
    assert job["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert job["spec"]["backoffLimit"] == 4
    (rule,) = job["spec"]["podFailurePolicy"]["rules"]
    assert rule == {
        "action": "FailJob",
        "onExitCodes": {"containerName": "fetch", "operator": "In", "values": [2]},
    }
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"] == [
        "fetch-model",
        "--source",
        source,
        "--into",
        f"/cache/{spec.source.cache_folder}",
        "--endpoint",
        "http://127.0.0.1:9000",
    ]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert pod["restartPolicy"] == "Never" and pod["serviceAccountName"] == "tiny-loader"
    assert "automountServiceAccountToken" not in pod  # the loader patches its own pod's progress
    env = env_of(container)
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    for key, optional in keys.items():
        assert env[key]["valueFrom"]["secretKeyRef"] == {
            "name": "creds",
            "key": key,
            **({"optional": True} if optional else {}),
        }
    assert volume(pod, "graph-cache")["persistentVolumeClaim"]["claimName"] == "tiny-graph-cache"
    anonymous = build_loader_job(MODEL, spec_of(source), settings, "k")
    assert not any(
        "secretKeyRef" in e.get("valueFrom", {})
        for e in anonymous["spec"]["template"]["spec"]["containers"][0]["env"]
    )


def test_loader_access_may_only_get_and_patch_pods():
    account, role, binding = build_loader_access(MODEL)
    assert [o["kind"] for o in (account, role, binding)] == ["ServiceAccount", "Role", "RoleBinding"]
    assert {o["metadata"]["name"] for o in (account, role, binding)} == {"tiny-loader"}
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"]}]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tiny-loader", "namespace": "ml"}]
    assert all(o["metadata"]["ownerReferences"][0]["uid"] == "u-1" for o in (account, role, binding))


def pod(name, progress=None, exit_code=None, message="", waiting=None, created="t1"):
    state = {}
    if exit_code is not None:
        state = {"terminated": {"exitCode": exit_code, "message": message}}
    elif waiting:
        state = {"waiting": {"reason": waiting, "message": 'secret "creds" not found'}}
    return {
        "metadata": {
            "name": name,
            "labels": {"job-name": "tiny-fetch-k"},
            "annotations": {PROGRESS_ANNOTATION: progress} if progress else {},
            "creationTimestamp": created,
        },
        "status": {"containerStatuses": [{"name": "fetch", "state": state}]},
    }


FAILED = {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}


@pytest.mark.parametrize(
    ("job_status", "pods", "expect"),
    [
        (None, [], (False, False, "Downloading", "creating the loader Job")),
        ({}, [pod("p1", "1024/4096")], (False, False, "Downloading", "1024 of 4096 bytes (loader Job")),
        ({}, [pod("p1", waiting="CreateContainerConfigError")], (False, False, "Downloading", "cannot")),
        ({"succeeded": 1}, [pod("p1", "4096/4096")], (True, False, "Cached", "cached the model: 4096 bytes")),
        (
            {},
            [pod("p1", exit_code=2, message="Traceback\nbad credentials: refused")],
            (False, True, "DownloadFailed", "exit code 2: bad credentials: refused"),
        ),
        (
            FAILED,
            [
                pod("p1", exit_code=1, message="a", created="t1"),
                pod("p2", exit_code=1, message="hub gone", created="t2"),
            ],
            (False, True, "DownloadFailed", "exit code 1: hub gone"),
        ),
        ({}, [pod("p1", exit_code=1, message="reset")], (False, False, "Downloading", "starting")),
        # while the Job retries, the last attempt's one line (issue 37: not "starting" through every retry)
        (
            {},
            [pod("p1", exit_code=1, message="Traceback\nhf://org/tiny: network error: connection refused")],
            (False, False, "Downloading", "last attempt failed: exit code 1: hf://org/tiny: network error"),
        ),
        (
            {},
            [pod("p1", exit_code=1, message="dns", created="t1"), pod("p2", "10/40", created="t2")],
            (
                False,
                False,
                "Downloading",
                "10 of 40 bytes (loader Job tiny-fetch-k; its last attempt failed: ",
            ),
        ),
        # the final word points at what works without reaching the store
        (
            FAILED,
            [pod("p1", exit_code=1, message="offline")],
            (False, True, "DownloadFailed", "spec.model.endpoint"),
        ),
        (
            FAILED,
            [pod("p1", exit_code=1, message="offline")],
            (False, True, "DownloadFailed", "a pvc:// claim or an oci:// image"),
        ),
    ],
)
def test_observe_loader(job_status, pods, expect):
    job = None if job_status is None else {"metadata": {"name": "tiny-fetch-k"}, "status": job_status}
    state = observe_loader(job, pods, "k", PROGRESS_ANNOTATION)
    ready, failed, reason, words = expect
    assert (state.is_ready, state.is_failed, state.reason) == (ready, failed, reason)
    assert words in state.message


@pytest.mark.parametrize(
    ("state", "ready", "progressing", "stalled"),
    [
        (
            ModelCacheState("k", False, False, "Downloading", "10 of 20 bytes"),
            "False",
            "WaitingForModel",
            "False",
        ),
        (ModelCacheState("k", True, False, "Cached", "cached: 20 bytes"), "True", "RolloutComplete", "False"),
        (
            ModelCacheState("k", False, True, "DownloadFailed", "bad credentials"),
            "False",
            "WaitingForModel",
            "True",
        ),
    ],
)
def test_model_cached_condition_and_kstatus(state, ready, progressing, stalled):
    pods = [PodView("p", "h", is_ready=True, created="t")] if state.is_ready else []
    status = compute_status(
        generation=1,
        replicas=1,
        template_hash="h",
        pods=pods,
        health=[],
        selector="s",
        service_address=None,
        card_resource="ibm.com/spyre_pf",
        model_cache=state,
    )
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["ModelCached"]["status"] == ("True" if state.is_ready else "False")
    assert conds["ModelCached"]["reason"] == state.reason and conds["ModelCached"]["message"] == state.message
    assert conds["Ready"]["status"] == ready and conds["Progressing"]["reason"] == progressing
    assert conds["Stalled"]["status"] == stalled
    if state.is_failed:
        assert conds["Stalled"]["reason"] == "DownloadFailed" and conds["Reconciling"]["status"] == "False"
    elif not state.is_ready:  # kstatus InProgress, Argo CD Progressing
        assert (
            conds["Reconciling"]["status"] == "True" and conds["Reconciling"]["reason"] == "WaitingForModel"
        )


def test_model_settings():
    settings = load_settings(
        {"SPYRE_OPERATOR_OCI_MODE": "image-volume", "SPYRE_OPERATOR_ALLOW_HOST_PATH": "1"}
    )
    assert (settings.oci_mode, settings.allow_host_path, settings.loader_retries) == ("image-volume", True, 2)
    assert OperatorSettings().oci_mode == "modelcar"  # works on every cluster
    with pytest.raises(
        SettingsError, match="SPYRE_OPERATOR_OCI_MODE='sidecar' must be one of modelcar, image-volume"
    ):
        load_settings({"SPYRE_OPERATOR_OCI_MODE": "sidecar"})
    with pytest.raises(SettingsError, match="SPYRE_OPERATOR_LOADER_RETRIES='-1'"):
        load_settings({"SPYRE_OPERATOR_LOADER_RETRIES": "-1"})


@pytest.mark.parametrize("scheme", ["s3", "hf", "oci"])
def test_the_examples_are_admitted(scheme):
    import yaml

    from tests.conftest import REPO

    docs = yaml.safe_load_all((REPO / f"examples/model-from-{scheme}.yaml").read_text())
    (model,) = [d for d in docs if d["kind"] == "SpyreModel"]
    spec = check_spec(model["metadata"]["name"], model["spec"], OperatorSettings())
    assert spec.source.scheme == scheme and spec.source.path_in_pod == "/models"


def test_rendered_objects_validate_against_the_published_schemas():
    """What the 1.20 test control plane cannot check: the image volume (1.31+), its subPath and the loader
    Job's pod failure policy, against Kubernetes' own schemas (kubernetes-validate)."""
    import kubernetes_validate
    from spyre_operator.kinds.pods.template import build_pod

    oci, s3 = spec_of("oci://quay.io/org/tiny:1"), spec_of("s3://bucket/tiny", secretRef="creds")
    objects = [
        build_pod(MODEL, oci, OperatorSettings(oci_mode="image-volume")),
        build_pod(MODEL, oci, OperatorSettings(oci_mode="modelcar")),
        build_pod(MODEL, s3, OperatorSettings()),
        build_loader_job(MODEL, s3, OperatorSettings(), s3.source.fetch_key),
        *build_loader_access(MODEL),
    ]
    for body in objects:
        body["metadata"].setdefault("name", "tiny-x")
        for version in ("1.33.0", kubernetes_validate.latest_version()):
            kubernetes_validate.validate(body, version, strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):  # 1.30 has no image volumes
        kubernetes_validate.validate(objects[0], "1.30.0", strict=True)


def test_chart_values_reach_the_operator_and_the_default_runtime_image_is_the_one_built():
    import yaml

    from tests.conftest import REPO
    from tests.test_chart import by_kind, env_of, render

    env = env_of(by_kind(render(), "Deployment")[0])
    assert (env["SPYRE_OPERATOR_OCI_MODE"], env["SPYRE_OPERATOR_LOADER_RETRIES"]) == ("modelcar", "2")
    assert "SPYRE_OPERATOR_ALLOW_HOST_PATH" not in env
    models = {"ociMode": "image-volume", "loaderRetries": 5, "allowHostPath": True}
    env = env_of(by_kind(render({"models": models}), "Deployment")[0])
    settings = load_settings(env)
    assert (settings.oci_mode, settings.loader_retries, settings.allow_host_path) == ("image-volume", 5, True)
    # the chart's, the operator's and the README's runtime image: the tag is the chart's appVersion
    chart = yaml.safe_load((REPO / "charts/spyre-operator/Chart.yaml").read_text())
    values = yaml.safe_load((REPO / "charts/spyre-operator/values.yaml").read_text())
    image = f"quay.io/spyre-serve/runtime:{chart['appVersion']}"
    assert values["runtimeImage"] == OperatorSettings().runtime_image == image
    assert f"podman build -f Containerfile.runtime -t {image} ." in (REPO / "README.md").read_text()


def test_an_image_volume_the_api_server_did_not_keep_is_found():
    from spyre_operator.spec.model_source import dropped_image_volumes

    spec = spec_of("oci://quay.io/org/tiny:1")
    pod = pod_template("tiny", spec, OperatorSettings(oci_mode="image-volume"))
    sent = {"spec": pod}
    # what a 1.20 API server answers: the image source dropped, the volume defaulted to an emptyDir
    stored = {
        "spec": {**pod, "volumes": [{**v, "image": None} if "image" in v else v for v in pod["volumes"]]}
    }
    for v in stored["spec"]["volumes"]:
        if v.pop("image", False) is None:
            v["emptyDir"] = {}
    assert dropped_image_volumes(sent, stored) == ["model"]
    assert dropped_image_volumes(sent, sent) == []
    job = build_compile_job(MODEL, spec, OperatorSettings(oci_mode="image-volume"), "k")
    assert dropped_image_volumes(job, {"spec": {"template": {"spec": {"volumes": []}}}}) == ["model"]
    modelcar = pod_template("tiny", spec, OperatorSettings())
    assert dropped_image_volumes({"spec": modelcar}, {"spec": {"volumes": []}}) == []
