"""The model's InferencePool (gateway.py builds it): made once; what the operator owns of it (selector, target
ports, protocol, endpoint picker) restored when someone changed it; removed when the spec no longer wants it.
A cluster that does not serve the InferencePool API (the Gateway API Inference Extension's CRDs are not
installed) is no error: the model serves through its Service, condition InferencePoolReady says why it has no
pool, one Event says it once, and the API is asked again once per resync period, so the pool is made once the
CRD is installed. A pool of the model's name that the model does not own is for a human to settle."""

from __future__ import annotations

import time

from kubernetes.client.rest import ApiException

from spyre_operator import gateway, manifests
from spyre_operator.events import EventRecorder
from spyre_operator.kube import Kube, problem_of
from spyre_operator.model_spec import ModelSpec
from spyre_operator.settings import POOL_GROUP, POOL_VERSION, OperatorSettings
from spyre_operator.status import PoolState, Problem
from spyre_operator.watch import Key
from spyre_operator.work import Pass

UNAVAILABLE = PoolState(
    False,
    "InferencePoolUnavailable",
    f"this cluster does not serve InferencePools ({POOL_GROUP}/{POOL_VERSION}: install the Gateway API "
    "Inference Extension's CRDs); the model serves through its Service, and its InferencePool is made once "
    "the API is served",
)


class InferencePoolStep:
    def __init__(self, settings: OperatorSettings, kube: Kube, events: EventRecorder) -> None:
        self.settings = settings
        self.kube = kube
        self.events = events
        self._states: dict[Key, PoolState] = {}
        self._unserved_until = 0.0  # (monotonic) the API was not served: not asked again before then

    def state(self, key: Key) -> PoolState | None:
        """What the last check found, for the status; None when the model wants no pool."""
        return self._states.get(key)

    def forget(self, key: Key) -> None:
        self._states.pop(key, None)

    def ensure(self, key: Key, model: dict, spec: ModelSpec, work: Pass) -> bool:
        """True when settled for the model's generation (its pool as specified, or none wanted and none
        left); False when it must be looked at again (the API not served yet, or a problem in `work`)."""
        want = gateway.build_inference_pool(model, spec, self.settings)
        if want is None:
            self._states.pop(key, None)
            return self._remove(model, work)
        state = None
        if time.monotonic() >= self._unserved_until:
            try:
                state = self._apply(model, want, work)
            except ApiException as e:
                problem = problem_of(gateway.KIND, e)
                work.problems.append(problem)
                state = PoolState(False, problem.reason, problem.message)
            if state is None:
                self._unserved_until = time.monotonic() + self.settings.resync_seconds
        if state is None:
            self.events.post(model, "Warning", UNAVAILABLE.reason, UNAVAILABLE.message)  # once per model
            state = UNAVAILABLE
        self._states[key] = state
        return state.is_ready

    def _apply(self, model: dict, want: dict, work: Pass) -> PoolState | None:
        """Makes or repairs the pool; None when the cluster does not serve the API."""
        name, namespace = want["metadata"]["name"], want["metadata"]["namespace"]
        try:
            created = self.kube.create_unless_exists(want)
        except ApiException as e:
            if e.status == 404:  # no such resource: the CRD is not installed
                return None
            raise
        if created:
            self.events.post(model, "Normal", "InferencePoolCreated", gateway.describe(want))
            return PoolState(True, "Reconciled", gateway.describe(want))
        have = self.kube.read(gateway.KIND, name, namespace)
        if have is None:  # removed meanwhile: the next pass makes it
            raise ApiException(status=409, reason="InferencePool was being removed")
        if not manifests.is_owned_by(have, model):
            problem = Problem(
                "InferencePoolConflict",
                f"InferencePool {name} exists and is not owned by this SpyreModel: remove it, or set "
                "spec.inferencePool.enabled to false",
            )
            work.problems.append(problem)
            return PoolState(False, problem.reason, problem.message)
        patch = gateway.pool_repair(have, want)
        if patch:
            self.kube.patch(gateway.KIND, name, namespace, patch)
            fields = ", ".join(op["path"].rsplit("/", 1)[1] for op in patch)
            message = f"InferencePool {name}: {fields} restored"
            self.events.post(model, "Normal", "InferencePoolRepaired", message)
        return PoolState(True, "Reconciled", gateway.describe(want))

    def _remove(self, model: dict, work: Pass) -> bool:
        """The model's own pool goes when the spec no longer wants one (a pool it does not own stays)."""
        if time.monotonic() < self._unserved_until:
            return True
        name, namespace = model["metadata"]["name"], model["metadata"]["namespace"]
        try:
            have = self.kube.read(gateway.KIND, name, namespace)  # None also when the API is not served
            if have is not None and manifests.is_owned_by(have, model):
                self.kube.delete(gateway.KIND, name, namespace)
                message = f"InferencePool {name}: spec.inferencePool is off"
                self.events.post(model, "Normal", "InferencePoolDeleted", message)
        except ApiException as e:
            work.problems.append(problem_of(gateway.KIND, e))
            return False
        return True
