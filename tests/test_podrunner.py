"""The local pod runner on its own: volumes as directories (ConfigMap, Secret files), env rewriting,
Jobs that complete, restarts per restartPolicy with the last termination reason."""

from __future__ import annotations

import pytest
from kubernetes import client

from tests.cluster.stack import LocalStack

pytestmark = pytest.mark.cluster
NS = "runner"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with LocalStack(tmp_path_factory.mktemp("runner")).running(NS) as s:
        yield s


def pod_spec(command: list[str], restart: str, volumes=(), mounts=(), env=()) -> dict:
    return {
        "restartPolicy": restart,
        "automountServiceAccountToken": False,
        "volumes": list(volumes),
        "containers": [
            {
                "name": "main",
                "image": "spyre-serve/runtime:dev",
                "command": command,
                "env": list(env),
                "volumeMounts": list(mounts),
            }
        ],
    }


def test_job_with_configmap_and_secret_files_completes(stack):
    core, batch = client.CoreV1Api(stack.kube), client.BatchV1Api(stack.kube)
    core.create_namespaced_config_map(NS, {"metadata": {"name": "cfg"}, "data": {"greeting": "hello"}})
    core.create_namespaced_secret(NS, {"metadata": {"name": "sec"}, "stringData": {"token": "s3cret"}})
    script = (
        "import os, sys; g = open(os.environ['CFG'] + '/greeting').read(); "
        "t = open(os.environ['SEC'] + '/token').read(); sys.exit(0 if (g, t) == ('hello', 's3cret') else 7)"
    )
    spec = pod_spec(
        ["python", "-c", script],
        "Never",
        volumes=[
            {"name": "cfg", "configMap": {"name": "cfg"}},
            {"name": "sec", "secret": {"secretName": "sec"}},
        ],
        mounts=[{"name": "cfg", "mountPath": "/etc/cfg"}, {"name": "sec", "mountPath": "/etc/sec"}],
        env=[{"name": "CFG", "value": "/etc/cfg"}, {"name": "SEC", "value": "/etc/sec"}],
    )
    batch.create_namespaced_job(
        NS, {"metadata": {"name": "check"}, "spec": {"backoffLimit": 0, "template": {"spec": spec}}}
    )
    job = stack.wait(
        lambda: (batch.read_namespaced_job("check", NS).status.succeeded or 0) >= 1 and True,
        90,
        "the Job to complete",
    )
    assert job
    pods = core.list_namespaced_pod(NS, label_selector="job-name=check").items
    assert pods[0].status.phase == "Succeeded"
    assert pods[0].status.container_statuses[0].state.terminated.exit_code == 0


def test_failing_container_restarts_with_last_state(stack):
    core = client.CoreV1Api(stack.kube)
    spec = pod_spec(
        ["python", "-c", "print('warming up'); raise SystemExit('error: bad shape 100')"], "Always"
    )
    spec["containers"][0]["terminationMessagePolicy"] = "FallbackToLogsOnError"
    core.create_namespaced_pod(NS, {"metadata": {"name": "crasher"}, "spec": spec})

    def restarted():
        cs = (core.read_namespaced_pod("crasher", NS).status.container_statuses or [None])[0]
        return cs if cs and cs.restart_count >= 1 and cs.last_state.terminated else None

    cs = stack.wait(restarted, 60, "a restart")
    assert cs.last_state.terminated.exit_code == 1 and cs.last_state.terminated.reason == "Error"
    # the log's tail is the termination message (FallbackToLogsOnError), last line last
    assert cs.last_state.terminated.message.splitlines()[-1] == "error: bad shape 100"
    core.delete_namespaced_pod("crasher", NS)
    stack.wait(
        lambda: not [p for p in core.list_namespaced_pod(NS).items if p.metadata.name == "crasher"],
        60,
        "the pod removed",
    )


def _waiting(core, name: str):
    cs = (core.read_namespaced_pod(name, NS).status.container_statuses or [None])[0]
    return cs.state.waiting if cs and cs.state and cs.state.waiting else None


SECRET_ENV = [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "hub", "key": "token"}}}]
CONFIG_ENV = [{"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "absent"}}}]
STRICT = [
    (
        "bad-image",
        "Spyre Serve/runtime",
        (),
        "InvalidImageName",
        "couldn't parse image reference \"Spyre Serve/",
    ),
    ("no-pull", "registry.invalid/runtime:gone", (), "ErrImagePull", "failed to pull and unpack image"),
    (
        "no-secret",
        "spyre-serve/runtime:dev",
        SECRET_ENV,
        "CreateContainerConfigError",
        'secret "hub" not found',
    ),
    (
        "no-key",
        "spyre-serve/runtime:dev",
        CONFIG_ENV,
        "CreateContainerConfigError",
        "couldn't find key absent",
    ),
]


@pytest.mark.parametrize(("name", "image", "env", "reason", "message"), STRICT, ids=[s[0] for s in STRICT])
def test_a_pod_the_kubelet_would_not_start_waits_with_its_reason(stack, name, image, env, reason, message):
    core = client.CoreV1Api(stack.kube)
    stack.runner.unpullable.add("registry.invalid/runtime:gone")
    spec = pod_spec(["python", "-c", "import time; time.sleep(600)"], "Always", env=env)
    spec["containers"][0]["image"] = image
    core.create_namespaced_pod(NS, {"metadata": {"name": name}, "spec": spec})
    waiting = stack.wait(lambda: _waiting(core, name), 60, f"{name} waiting")
    assert waiting.reason == reason and message in waiting.message, waiting
    assert core.read_namespaced_pod(name, NS).status.phase == "Pending"
    assert not [a for a in stack.runner.admitted if a[:2] == (NS, name)]  # no process was started


def test_a_pod_starts_once_its_missing_secret_exists(stack):
    core = client.CoreV1Api(stack.kube)
    env = [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "late", "key": "token"}}}]
    script = "import os, time; open('token', 'w').write(os.environ['TOKEN']); time.sleep(600)"
    core.create_namespaced_pod(
        NS, {"metadata": {"name": "late"}, "spec": pod_spec(["python", "-c", script], "Always", env=env)}
    )
    waiting = stack.wait(lambda: _waiting(core, "late"), 60, "late waiting")
    assert waiting.reason == "CreateContainerConfigError"
    core.create_namespaced_secret(NS, {"metadata": {"name": "late"}, "stringData": {"token": "t0ken"}})
    stack.wait(lambda: core.read_namespaced_pod("late", NS).status.phase == "Running", 60, "late Running")
    rp = next(rp for rp in stack.runner.pods.values() if (rp.namespace, rp.name) == (NS, "late"))
    assert (
        stack.wait(
            lambda: (rp.workdir / "token").exists() and (rp.workdir / "token").read_text(), 30, "token"
        )
        == "t0ken"
    )


def test_a_write_through_a_read_only_mount_fails(stack):
    """The same emptyDir mounted twice: writable at /data, readOnly at /view. Written at /data, the file
    reads back through /view; a write through /view fails with EROFS, as in a container."""
    batch, core = client.BatchV1Api(stack.kube), client.CoreV1Api(stack.kube)
    script = (  # the paths come through env, which the runner rewrites to the local folders
        "import errno, os, sys\n"
        "data, view = os.environ['DATA'], os.environ['VIEW']\n"
        "open(data + '/f', 'w').write('x')\n"
        "assert open(view + '/f').read() == 'x'\n"
        "for path in (view + '/f', view + '/new'):\n"
        "    try:\n"
        "        open(path, 'w').write('y')\n"
        "    except OSError as e:\n"
        "        assert e.errno == errno.EROFS, e\n"
        "    else:\n"
        "        sys.exit(f'wrote {path}')\n"
    )
    spec = pod_spec(
        ["python", "-c", script],
        "Never",
        volumes=[{"name": "scratch", "emptyDir": {}}],
        mounts=[
            {"name": "scratch", "mountPath": "/data"},
            {"name": "scratch", "mountPath": "/view", "readOnly": True},
        ],
        env=[{"name": "DATA", "value": "/data"}, {"name": "VIEW", "value": "/view"}],
    )
    batch.create_namespaced_job(
        NS, {"metadata": {"name": "ro"}, "spec": {"backoffLimit": 0, "template": {"spec": spec}}}
    )

    def finished():
        job = batch.read_namespaced_job("ro", NS).status
        return (job.succeeded or job.failed) and job

    job = stack.wait(finished, 90, "the Job to finish")
    (pod,) = core.list_namespaced_pod(NS, label_selector="job-name=ro").items
    rp = next(rp for rp in stack.runner.pods.values() if rp.name == pod.metadata.name)
    assert job.succeeded == 1, rp.log.read_text(errors="replace")


def test_run_as_non_root_with_an_image_that_runs_as_root_never_starts(stack):
    core = client.CoreV1Api(stack.kube)
    root_image = "registry.example.com/tools/busybox:1"  # no USER line: root
    for name, image in (("as-root", root_image), ("as-1001", "spyre-serve/runtime:dev")):
        spec = pod_spec(["python", "-c", "import time; time.sleep(600)"], "Always")
        spec["securityContext"] = {"runAsNonRoot": True}
        spec["containers"][0]["image"] = image
        core.create_namespaced_pod(NS, {"metadata": {"name": name}, "spec": spec})
    waiting = stack.wait(lambda: _waiting(core, "as-root"), 60, "as-root waiting")
    assert waiting.reason == "CreateContainerConfigError"
    assert waiting.message.startswith("container has runAsNonRoot and image will run as root (pod: ")
    assert not [a for a in stack.runner.admitted if a[:2] == (NS, "as-root")]
    # the runtime image's user (Containerfile.runtime: USER 1001) passes; so does a root image given a user
    stack.wait(lambda: core.read_namespaced_pod("as-1001", NS).status.phase == "Running", 60, "as-1001")
    stack.runner.image_users[root_image] = "65532"
    stack.wait(lambda: core.read_namespaced_pod("as-root", NS).status.phase == "Running", 60, "as-root")


def test_an_init_container_the_kubelet_refuses_keeps_the_pod_initializing(stack):
    core = client.CoreV1Api(stack.kube)
    spec = pod_spec(["python", "-c", "import time; time.sleep(600)"], "Always")
    spec["initContainers"] = [{"name": "modelcar", "image": "quay.io/Org/model:1", "command": ["true"]}]
    core.create_namespaced_pod(NS, {"metadata": {"name": "bad-init"}, "spec": spec})

    def init_waiting():
        statuses = core.read_namespaced_pod("bad-init", NS).status.init_container_statuses or []
        return statuses and statuses[0].state.waiting

    waiting = stack.wait(init_waiting, 60, "the init container waiting")
    assert waiting.reason == "InvalidImageName"
    assert "repository name (Org/model) must be lowercase" in waiting.message
    assert _waiting(core, "bad-init").reason == "PodInitializing"
    assert not [a for a in stack.runner.admitted if a[:2] == (NS, "bad-init")]
