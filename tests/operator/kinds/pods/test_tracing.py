"""Request traces reach the model's pods: spec.tracing.otlpEndpoint, else the operator's setting (chart value
tracing.otlpEndpoint), set on the runtime container as OpenTelemetry's own variable, with the model's name
as the service's; nothing when neither says (the template, and so existing pods, unchanged); a bad endpoint
refused as InvalidSpec or SettingsError naming the field."""

from __future__ import annotations

import pytest
from spyre_operator.kinds.pods.template import build_pod, pod_template
from spyre_operator.settings import OperatorSettings, SettingsError, load_settings
from spyre_operator.spec.model_spec import InvalidSpec

from tests.operator.objects import MODEL, env_of, spec_of
from tests.test_chart import by_kind, render
from tests.test_chart import env_of as deployment_env

SETTINGS = OperatorSettings()


def test_no_endpoint_no_variable_and_the_template_as_it_was():
    spec = spec_of()
    env = env_of(build_pod(MODEL, spec, SETTINGS))
    assert not [name for name in env if name.startswith("OTEL_")]
    assert pod_template("granite", spec, SETTINGS) == pod_template("granite", spec_of(tracing={}), SETTINGS)


def test_the_spec_endpoint_wins_over_the_operators_and_gets_the_traces_path():
    operator_wide = OperatorSettings(otlp_traces_endpoint="http://fleet-collector:4318/v1/traces")
    env = env_of(build_pod(MODEL, spec_of(), operator_wide))
    assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == "http://fleet-collector:4318/v1/traces"
    assert env["OTEL_SERVICE_NAME"] == "granite"
    own = spec_of(tracing={"otlpEndpoint": "https://team-collector.obs:4318"})
    env = env_of(build_pod(MODEL, own, operator_wide))
    assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == "https://team-collector.obs:4318/v1/traces"


def test_a_users_own_variable_in_spec_env_comes_last_and_wins():
    spec = spec_of(
        tracing={"otlpEndpoint": "http://c:4318"},
        env=[{"name": "OTEL_SERVICE_NAME", "value": "mine"}],
    )
    env = build_pod(MODEL, spec, SETTINGS)["spec"]["containers"][0]["env"]
    assert [e["value"] for e in env if e["name"] == "OTEL_SERVICE_NAME"][-1] == "mine"


@pytest.mark.parametrize("url", ["collector:4318", "grpc://c:4317", "http://", "http://c:99999", 4318])
def test_a_bad_spec_endpoint_is_refused(url):
    with pytest.raises(InvalidSpec, match=r"tracing\.otlpEndpoint"):
        spec_of(tracing={"otlpEndpoint": url})


def test_the_chart_value_reaches_the_operator_setting():
    assert "SPYRE_OPERATOR_OTLP_TRACES_ENDPOINT" not in deployment_env(by_kind(render(), "Deployment")[0])
    values = {"tracing": {"otlpEndpoint": "http://otel-collector.monitoring:4318"}}
    env = deployment_env(by_kind(render(values), "Deployment")[0])
    settings = load_settings(
        {"SPYRE_OPERATOR_OTLP_TRACES_ENDPOINT": env["SPYRE_OPERATOR_OTLP_TRACES_ENDPOINT"]}
    )
    assert settings.otlp_traces_endpoint == "http://otel-collector.monitoring:4318/v1/traces"
    with pytest.raises(SettingsError, match="SPYRE_OPERATOR_OTLP_TRACES_ENDPOINT"):
        load_settings({"SPYRE_OPERATOR_OTLP_TRACES_ENDPOINT": "otel-collector:4318"})
