"""Scale benchmark of the operator: N SpyreModels applied at once on the real control plane.

    .venv/bin/python bench/operator_scale.py [--models 100,300,1000] [--operator-replicas 1] [--resync 10]
                                             [--timeout 600] [--out bench/results-operator.json]

One run per count, each on a fresh control plane sized for it (N/8 pseudo nodes of 8 cards).
Reports the time until every model has its pod created and a Ready status, the API requests the operator
made per model (from the API server's audit log, by the operator's service account), its peak RSS, and the
writes it made during an idle resync. Writes bench/results-operator.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from kubernetes import client

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.cluster.audit import WRITE_VERBS, audit_args, audit_counts  # noqa: E402
from tests.cluster.controlplane import ControlPlane, spyre_nodes  # noqa: E402
from tests.cluster.fakekubelet import FakeKubelet  # noqa: E402
from tests.conftest import kubectl  # noqa: E402
from tests.operator.conftest import OperatorProcess, service_account_kubeconfig  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="200", help="a count or a comma list of counts")
    ap.add_argument("--resync", type=float, default=10.0)
    ap.add_argument("--operator-replicas", type=int, default=1, help="2: a leader and a standby")
    ap.add_argument("--out", default=str(REPO / "bench/results-operator.json"))
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for every model to be Ready")
    args = ap.parse_args()
    rows = []
    for count in [int(c) for c in args.models.split(",")]:
        rows.append(run(count, args.resync, args.operator_replicas, args.timeout))
        print(json.dumps(rows[-1], indent=2), flush=True)
    Path(args.out).write_text(json.dumps(rows if len(rows) > 1 else rows[0], indent=2))
    return 0


def run(models: int, resync: float, operator_replicas: int, timeout: float = 600.0) -> dict:
    args = argparse.Namespace(models=models, resync=resync)
    work = Path(tempfile.mkdtemp(prefix="spyre-scale-"))
    audit = work / "audit.log"
    cp = ControlPlane(workdir=work / "cluster", extra_apiserver_args=audit_args(work))
    cp.start()
    results: dict = {"models": args.models}
    op = None
    try:
        kube = cp.api_client()
        cp.register_nodes(spyre_nodes(count=-(-args.models // 8), cards=8))
        kubectl(cp, "apply", "--validate=false", "-f", str(REPO / "crds/spyremodels.yaml"))
        kubectl(cp, "wait", "--for=condition=established", "crd/spyremodels.spyre-serve.io")
        kubectl(cp, "create", "namespace", "spyre-system")
        kubectl(cp, "apply", "-f", str(REPO / "deploy/rbac/clusterrole.yaml"))
        kubectl(cp, "create", "namespace", "scale")
        core, custom = client.CoreV1Api(kube), client.CustomObjectsApi(kube)
        models_claim = {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}
        core.create_namespaced_persistent_volume_claim(
            "scale", {"metadata": {"name": "models"}, "spec": models_claim}
        )
        kc = service_account_kubeconfig(
            cp, kube, "spyre-system", "spyre-operator", work / "operator.kubeconfig"
        )
        # the models are file:// ones (no claim to provision per model): host paths allowed, as an admin would
        env = {"SPYRE_OPERATOR_RESYNC_SECONDS": str(args.resync), "SPYRE_OPERATOR_ALLOW_HOST_PATH": "1"}
        op = OperatorProcess(kc, work / "operator.log", env)
        op.start()
        standbys = [
            OperatorProcess(kc, work / f"standby{i}.log", env).start() for i in range(operator_replicas - 1)
        ]
        procs = [psutil.Process(o.proc.pid) for o in [op, *standbys]]
        peak = [0] * len(procs)
        stop = threading.Event()

        def watch_rss():
            while not stop.wait(0.2):
                for i, proc in enumerate(procs):
                    with contextlib.suppress(psutil.Error):
                        peak[i] = max(peak[i], proc.memory_info().rss)

        threading.Thread(target=watch_rss, daemon=True).start()
        time.sleep(5)  # operator up and watching
        spec = {
            "model": {"source": "pvc://models/tiny"},  # file:// is refused unless host paths are allowed
            "replicas": 1,
            "backend": "inductor",
            "batching": {"mode": "static", "shapes": [{"promptLength": 64, "newTokens": 16, "batchSize": 1}]},
            "graphCache": {"enabled": False},
        }
        with FakeKubelet(kube, "scale", period=1.0, workers=8):
            t0 = time.time()
            for i in range(args.models):
                custom.create_namespaced_custom_object(
                    "spyre-serve.io",
                    "v1alpha1",
                    "scale",
                    "spyremodels",
                    {
                        "apiVersion": "spyre-serve.io/v1alpha1",
                        "kind": "SpyreModel",
                        "metadata": {"name": f"m{i:03d}"},
                        "spec": spec,
                    },
                )
            applied = time.time() - t0

            def ready_count():
                items = custom.list_namespaced_custom_object(
                    "spyre-serve.io", "v1alpha1", "scale", "spyremodels"
                )["items"]
                refused = [m for m in items if (m.get("status") or {}).get("phase") == "Failed"]
                for m in refused:  # a model the operator refuses measures nothing: say so at once
                    conditions = {c["type"]: c for c in m["status"].get("conditions") or []}
                    stalled = conditions.get("Stalled", {})
                    raise SystemExit(
                        f"operator_scale: {m['metadata']['name']} was refused ({stalled.get('reason')}: "
                        f"{stalled.get('message')}): the bench measures nothing"
                    )
                return sum((m.get("status") or {}).get("phase") == "Ready" for m in items)

            while (n := ready_count()) < args.models:
                if time.time() - t0 > timeout:
                    results[f"not_converged_ready_after_{timeout:.0f}_s"] = n
                    break
                time.sleep(1)
            converged = time.time() - t0
            results["ready_models"] = n
            results["after_last_create_seconds"] = converged - applied
            pods = len(core.list_namespaced_pod("scale").items)
            time.sleep(3)
            counts = audit_counts(audit)
            total = sum(counts.values())
            idle_from = time.time() + 1
            time.sleep(2.5 * args.resync)  # two full resync passes over every model
            idle = audit_counts(audit, since=idle_from)
        stop.set()
        op.stop()
        for o in standbys:
            o.stop()
        results.update(
            {
                "apply_seconds": applied,
                "converge_seconds": converged,
                "pods": pods,
                "operator_requests_total": total,
                "operator_requests_per_model": total / args.models,
                "operator_requests_per_model_without_leases": sum(
                    n for (_, r, _), n in counts.items() if r != "leases"
                )
                / args.models,
                "operator_requests_by_kind": {
                    f"{v} {r}{'/' + s if s else ''}": n for (v, r, s), n in counts.most_common()
                },
                "operator_peak_rss_mb": peak[0] / 2**20,
                "operator_replicas": operator_replicas,
                "standby_peak_rss_mb": [p / 2**20 for p in peak[1:]],
                "idle_resync_seconds_watched": 2.5 * args.resync,
                # the leader's Lease renewals (every lease/3 s) are not reconcile traffic: counted apart
                "idle_resync_reads": sum(
                    n for (v, r, _), n in idle.items() if v not in WRITE_VERBS and r != "leases"
                ),
                "idle_resync_writes": sum(
                    n for (v, r, _), n in idle.items() if v in WRITE_VERBS and r != "leases"
                ),
                "idle_lease_requests": sum(n for (_, r, _), n in idle.items() if r == "leases"),
            }
        )
    finally:
        if op is not None:
            op.stop()
        cp.stop()
        shutil.rmtree(work, ignore_errors=True)  # etcd's data and the audit log: 100 MB at 1,000 models
    return results


if __name__ == "__main__":
    sys.exit(main())
