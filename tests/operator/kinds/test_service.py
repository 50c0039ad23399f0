"""The Service and the graph-cache claim, as built."""

from __future__ import annotations

from spyre_operator.kinds.graph_cache_claim import build_cache_claim
from spyre_operator.kinds.pods.template import (
    build_pod,
)
from spyre_operator.kinds.service import build_service
from spyre_operator.settings import MODEL_LABEL, OperatorSettings

from tests.operator.objects import MODEL, spec_of


def test_service_and_claim():
    s = OperatorSettings(default_storage_class="nfs")
    svc = build_service(MODEL, s)
    assert svc["spec"]["selector"] == {MODEL_LABEL: "granite"} and svc["spec"]["ports"][0]["port"] == 8000
    claim = build_cache_claim(MODEL, spec_of(), s)
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"] and claim["spec"]["storageClassName"] == "nfs"
    assert "ownerReferences" not in claim["metadata"]  # Retain by default
    deleting = build_cache_claim(MODEL, spec_of(graphCache={"retention": "Delete"}), s)
    assert deleting["metadata"]["ownerReferences"][0]["kind"] == "SpyreModel"
    assert build_cache_claim(MODEL, spec_of(graphCache={"existingClaim": "shared"}), s) is None
    pod = build_pod(MODEL, spec_of(graphCache={"existingClaim": "shared"}), s)
    assert {v["name"]: v for v in pod["spec"]["volumes"]}["graph-cache"]["persistentVolumeClaim"][
        "claimName"
    ] == "shared"
