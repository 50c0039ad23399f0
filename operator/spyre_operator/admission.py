"""Whether a SpyreModel can be served as written, before anything is made for it: its spec (parse_spec), where
its cards come from (check_placement), the runtime's own rules on it (check_fit), whether the cluster serves
DRA when the spec asks for it, then the API server's admission and validation of every object the spec makes,
asked in a dry run once per generation and template. A refusal is an InvalidSpec."""

from __future__ import annotations

import time

from kubernetes.client.rest import ApiException

from spyre_operator.io.kube import Kube, api_message, is_quota
from spyre_operator.io.watch import Key
from spyre_operator.kinds.compile_job import build_compile_job, cache_key
from spyre_operator.kinds.inference_pool import check_inference_pool
from spyre_operator.kinds.pods.template import build_pod
from spyre_operator.settings import HASH_LABEL, OperatorSettings
from spyre_operator.spec.model_source import dropped_image_volumes
from spyre_operator.spec.model_spec import InvalidSpec, ModelSpec
from spyre_operator.spec.parse import parse_spec
from spyre_operator.spec.placement import DRAUnavailable, check_placement
from spyre_operator.spec.runtime_contract import check_fit

DISCOVERY_SECONDS = 60.0  # how long an answer of the API server's discovery is trusted


def check_spec(name: str, raw: dict, settings: OperatorSettings) -> ModelSpec:
    """Everything the operator can tell from the spec and its own settings alone; raises InvalidSpec naming
    the first rule the spec breaks."""
    spec = parse_spec(name, raw)
    if refusal := spec.source.refusal(settings):  # e.g. file:// while host paths are off
        raise InvalidSpec("model.source", refusal)
    check_placement(spec, settings)
    check_inference_pool(spec, settings)
    check_fit(spec, settings)
    return spec


class Admission:
    def __init__(self, settings: OperatorSettings, kube: Kube) -> None:
        self.settings = settings
        self.kube = kube
        # key -> ((uid, generation, template hash), refusal or "", the field it names)
        self._validated: dict[Key, tuple] = {}
        self._serves_dra: tuple[float, bool] | None = None  # (when asked, the answer)

    def admit(self, key: Key, model: dict) -> ModelSpec:
        """The model's spec, validated; raises InvalidSpec naming the first rule it breaks."""
        spec = check_spec(key[1], model.get("spec") or {}, self.settings)
        if spec.devices is not None and not self._cluster_serves_dra():
            raise DRAUnavailable()
        self._dry_run(key, model, spec)
        return spec

    def _cluster_serves_dra(self) -> bool:
        """Asked once a minute at most (a cluster upgrade turns it on)."""
        if self._serves_dra is None or time.monotonic() - self._serves_dra[0] > DISCOVERY_SECONDS:
            self._serves_dra = (time.monotonic(), self.kube.serves_claim_templates())
        return self._serves_dra[1]

    def forget(self, key: Key) -> None:
        self._validated.pop(key, None)

    def _dry_run(self, key: Key, model: dict, spec: ModelSpec) -> None:
        """Asks the API server (dryRun=All: admission and validation, nothing stored) whether it would
        accept every object of this spec; a refusal is an InvalidSpec. Done once per generation."""
        meta = model["metadata"]
        pod = build_pod(model, spec, self.settings)
        # a fixed name, so the API server's message (and the condition) is the same at every pass
        pod["metadata"]["name"] = pod["metadata"].pop("generateName").rstrip("-")
        # token authorization's ServiceAccount is made after admission (kinds/access.py): not asked about here
        pod["spec"].pop("serviceAccountName", None)
        stamp = (meta["uid"], meta.get("generation"), pod["metadata"]["labels"][HASH_LABEL])
        seen = self._validated.get(key)
        if seen is not None and seen[0] == stamp:
            if seen[1]:
                raise InvalidSpec(seen[2], seen[1])
            return
        # the Service and the claim are built from fields checked above; their creation reports the rest
        attempts = [("Pod", pod)]
        if spec.cache.precompile:
            key_of_cache = cache_key(spec, self.settings)
            attempts.append(("Job", build_compile_job(model, spec, self.settings, key_of_cache)))
        for kind, body in attempts:
            try:
                stored = self.kube.create(body, dry_run=True)
            except ApiException as e:
                if e.status in (408, 409, 429) or is_quota(e) or (e.status or 500) >= 500:
                    continue  # exists already, quota (a rollout matter), or the server's trouble
                refusal = f"the API server refuses the {kind}: {api_message(e)}"
                self._validated[key] = (stamp, refusal, "")
                raise InvalidSpec("", refusal) from None
            if dropped := dropped_image_volumes(body, stored):
                # an API server without image volumes keeps the pod, the volume an empty emptyDir
                refusal = (
                    f"{spec.source.uri}: this cluster does not serve image volumes (its API server turned "
                    f"volume {dropped[0]!r} into an empty emptyDir; Kubernetes 1.31+ with the ImageVolume "
                    "feature, subPath 1.33+): set the operator's SPYRE_OPERATOR_OCI_MODE=modelcar"
                )
                self._validated[key] = (stamp, refusal, "model.source")
                raise InvalidSpec("model.source", refusal)
        self._validated[key] = (stamp, "", "")
