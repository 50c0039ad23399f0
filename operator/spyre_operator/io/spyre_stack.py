"""What the cluster's Spyre device stack decides for placement, read once at start-up: the IBM Spyre Operator
(its `SpyreClusterPolicy` CRD, group spyre.ibm.com) runs the secondary scheduler `spyre-scheduler`, and its
admission webhook refuses a Spyre pod that does not name it. So with no scheduler set
(SPYRE_OPERATOR_SCHEDULER_NAME, chart value schedulerName), inference pods name `spyre-scheduler` when that
CRD is installed and the cluster's default scheduler otherwise; the start-up log says which and why. Older
clusters (`ibm.com/aiu_pf`) name theirs explicitly: `aiu-scheduler`."""

from __future__ import annotations

import dataclasses
import logging

from kubernetes import client
from kubernetes.client.rest import ApiException

from spyre_operator.settings import ENV, OperatorSettings

SPYRE_POLICY_CRD = "spyreclusterpolicies.spyre.ibm.com"
SPYRE_SCHEDULER = "spyre-scheduler"
log = logging.getLogger(__name__)


def choose_scheduler(settings: OperatorSettings, has_policy: bool | None) -> tuple[OperatorSettings, str]:
    """The settings with the scheduler the inference pods name, and the start-up line that says why.
    `has_policy`: whether the SpyreClusterPolicy CRD is installed (None: the operator may not read CRDs)."""
    var = ENV["scheduler_name"]
    if settings.scheduler_name:
        return settings, f"inference pods name the scheduler {settings.scheduler_name} ({var})"
    if has_policy:
        chosen = dataclasses.replace(settings, scheduler_name=SPYRE_SCHEDULER)
        return chosen, (
            f"the Spyre operator's SpyreClusterPolicy CRD ({SPYRE_POLICY_CRD}) is installed: inference pods "
            f"name the scheduler {SPYRE_SCHEDULER} (set {var} to choose another)"
        )
    why = (
        f"no SpyreClusterPolicy CRD ({SPYRE_POLICY_CRD}) is installed"
        if has_policy is False
        else f"the operator may not read CustomResourceDefinitions to look for {SPYRE_POLICY_CRD}"
    )
    return settings, f"{why}: inference pods go to the cluster's default scheduler (set {var} to name one)"


def crd_installed(api_client: client.ApiClient, name: str, timeout: float) -> bool | None:
    """Whether the CustomResourceDefinition exists; None when the operator may not read it (a namespaced
    install's RBAC)."""
    try:
        client.ApiextensionsV1Api(api_client).read_custom_resource_definition(
            name, _preload_content=False, _request_timeout=timeout
        )
    except ApiException as e:
        if e.status == 404:
            return False
        if e.status == 403:
            return None
        raise
    return True


def resolve_scheduler(settings: OperatorSettings, api_client: client.ApiClient) -> OperatorSettings:
    """The settings with the scheduler chosen (choose_scheduler), said in the log."""
    has_policy = None
    if not settings.scheduler_name:
        has_policy = crd_installed(api_client, SPYRE_POLICY_CRD, settings.api_timeout_seconds)
    chosen, line = choose_scheduler(settings, has_policy)
    log.info(line)
    return chosen
