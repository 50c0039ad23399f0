"""The chart's alerts (templates/prometheusrule.yaml), rendered by the real Helm engine: promtool accepts
them, its unit tests (tests/alerts/alerts_test.yaml) show each alert firing and staying quiet, every
expression reads only metrics the code exports, and every alert's runbook_url is a section of the docs."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.conftest import REPO
from tests.monitoring import exported_metric_names, metric_names_in, prometheus_bin
from tests.test_chart import by_kind, render

UNIT_TESTS = REPO / "tests/alerts/alerts_test.yaml"
DOCS_PAGE = REPO / "docs/operations/alerts.md"
RUNBOOKS = "https://docs.example/operations/alerts/"


@pytest.fixture(scope="module")
def rule_groups() -> list[dict]:
    docs = render({"alerts": {"enabled": True, "runbookBaseURL": RUNBOOKS}})
    (rule,) = by_kind(docs, "PrometheusRule")
    return rule["spec"]["groups"]


def alerts(groups: list[dict]) -> list[dict]:
    return [r for g in groups for r in g["rules"] if "alert" in r]


def promtool(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([str(prometheus_bin("promtool")), *args], cwd=cwd, capture_output=True, text=True)


def test_no_rule_without_the_value():
    assert by_kind(render(), "PrometheusRule") == []


def test_promtool_accepts_the_rules_and_passes_their_unit_tests(rule_groups, tmp_path):
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups}))
    shutil.copy(UNIT_TESTS, tmp_path / "alerts_test.yaml")
    checked = promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alerts(rule_groups))} rules found" in checked.stdout
    tested = promtool("test", "rules", "alerts_test.yaml", cwd=tmp_path)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_promtool_unit_tests_fail_when_an_expectation_is_wrong(rule_groups, tmp_path):
    """The unit tests can fail: a KV cache at 85 % must not fire the alert the file expects."""
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups}))
    text = UNIT_TESTS.read_text()
    assert "'0.95x20'" in text
    (tmp_path / "alerts_test.yaml").write_text(text.replace("'0.95x20'", "'0.85x20'"))
    tested = promtool("test", "rules", "alerts_test.yaml", cwd=tmp_path)
    assert tested.returncode != 0
    assert "SpyreKVCacheFull" in tested.stdout + tested.stderr


def test_every_alert_is_unit_tested_firing_and_quiet(rule_groups):
    cases = [c for t in yaml.safe_load(UNIT_TESTS.read_text())["tests"] for c in t["alert_rule_test"]]
    for alert in alerts(rule_groups):
        name = alert["alert"]
        mine = [c for c in cases if c["alertname"] == name]
        assert any(c["exp_alerts"] for c in mine), f"{name}: no unit test where it fires"
        assert any(not c["exp_alerts"] for c in mine), f"{name}: no unit test where it stays quiet"


def test_every_expression_reads_only_exported_metrics(rule_groups):
    exported = exported_metric_names()
    for alert in alerts(rule_groups):
        names = metric_names_in(alert["expr"])
        assert names, f"{alert['alert']}: reads none of our metrics: {alert['expr']}"
        missing = sorted(names - exported)
        assert not missing, f"{alert['alert']} reads metrics nothing exports: {missing}"


def test_every_alert_has_a_runbook_section_in_the_docs(rule_groups):
    page = DOCS_PAGE.read_text()
    for alert in alerts(rule_groups):
        name = alert["alert"]
        assert alert["annotations"]["runbook_url"] == f"{RUNBOOKS}#{name.lower()}"
        assert f"\n## {name}\n" in page, f"{DOCS_PAGE.relative_to(REPO)} has no section for {name}"
        assert alert["labels"]["severity"] in {"info", "warning", "critical"}
