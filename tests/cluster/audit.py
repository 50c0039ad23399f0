"""The API server's audit log of one user's requests (the operator's service account by default): how to turn
it on for a ControlPlane, and the requests counted by verb, resource and subresource. The bench and the tests
that hold the operator to its request budget read the same log."""

from __future__ import annotations

import datetime
import json
from collections import Counter
from pathlib import Path

OPERATOR_USER = "system:serviceaccount:spyre-system:spyre-operator"
WRITE_VERBS = {"create", "update", "patch", "delete"}


def audit_args(workdir: Path, user: str = OPERATOR_USER) -> tuple[str, ...]:
    """kube-apiserver arguments that log `user`'s requests (their metadata, no bodies) into
    workdir/audit.log; nobody else's."""
    workdir.mkdir(parents=True, exist_ok=True)
    policy = workdir / "audit.yaml"
    policy.write_text(
        "apiVersion: audit.k8s.io/v1\nkind: Policy\nrules:\n"
        f'  - level: Metadata\n    users: ["{user}"]\n  - level: None\n'
    )
    return (
        f"--audit-policy-file={policy}",
        f"--audit-log-path={workdir / 'audit.log'}",
        "--audit-log-maxsize=1000",
    )


def audit_counts(
    path: Path, since: float = 0.0, namespace: str | None = None, user: str = OPERATOR_USER
) -> Counter:
    """`user`'s completed requests received at or after `since` (a time.time()), in `namespace` when given,
    by (verb, resource, subresource); a discovery request has resource ""."""
    counts: Counter = Counter()
    if not path.exists():
        return counts
    for line in path.read_text().splitlines():
        ev = json.loads(line)
        if ev.get("stage") != "ResponseComplete" or ev["user"]["username"] != user:
            continue
        ref = ev.get("objectRef") or {}
        if namespace is not None and ref.get("namespace") != namespace:
            continue
        stamp = datetime.datetime.fromisoformat(ev["requestReceivedTimestamp"].replace("Z", "+00:00"))
        if stamp.timestamp() >= since:
            counts[(ev["verb"], ref.get("resource", ""), ref.get("subresource", ""))] += 1
    return counts
