"""The operator's settings: from the environment and flags, every one with its parse rule."""

from __future__ import annotations

import pytest
from spyre_operator.settings import OperatorSettings, SettingsError, load_settings


def test_settings_env_and_flags():
    import argparse

    s = load_settings({"SPYRE_OPERATOR_CARD_RESOURCE": "ibm.com/aiu_pf", "SPYRE_OPERATOR_NAMESPACES": "a, b"})
    assert s.card_resource == "ibm.com/aiu_pf" and s.namespaces == ("a", "b")
    flags = argparse.Namespace(card_resource="ibm.com/spyre_pf", scheduler_name="spyre-scheduler")
    s = load_settings({"SPYRE_OPERATOR_CARD_RESOURCE": "ibm.com/aiu_pf"}, flags)
    assert (s.card_resource, s.scheduler_name) == ("ibm.com/spyre_pf", "spyre-scheduler")
    with pytest.raises(SettingsError, match="SPYRE_OPERATOR_CARD_RESOURCE='cards'"):
        load_settings({"SPYRE_OPERATOR_CARD_RESOURCE": "cards"})
    with pytest.raises(SettingsError, match="SPYRE_OPERATOR_RESYNC_SECONDS='-1' must be positive"):
        load_settings({"SPYRE_OPERATOR_RESYNC_SECONDS": "-1"})


def test_every_setting_has_a_parse_rule():
    from dataclasses import fields

    from spyre_operator.settings import ENV, PARSE

    assert list(PARSE) != [] and set(PARSE) == set(ENV) <= {f.name for f in fields(OperatorSettings)}
