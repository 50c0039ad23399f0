"""The cards a pod was given, read from the Spyre device plugin's PCIDEVICE_IBM_COM_* variables."""

import pytest
from spyre_contract import ContractError
from spyre_contract.devices import allocated_cards, describe_cards

TWO = {"PCIDEVICE_IBM_COM_SPYRE_PF": "0000:1a:00.0,0000:1b:00.0", "PATH": "/bin"}


def test_the_device_plugin_variables_name_the_cards():
    assert allocated_cards(TWO) == {"PCIDEVICE_IBM_COM_SPYRE_PF": ("0000:1a:00.0", "0000:1b:00.0")}
    tier = {"PCIDEVICE_IBM_COM_SPYRE_PF_TIER0": "0000:3d:00.0", "PCIDEVICE_IBM_COM_AIU_PF": "0000:3e:00.1"}
    assert sum(len(a) for a in allocated_cards(tier).values()) == 2
    assert allocated_cards({"PATH": "/bin"}) == {}


def test_a_malformed_address_is_named():
    with pytest.raises(
        ContractError, match=r"PCIDEVICE_IBM_COM_SPYRE_PF='0000:1a:00.0,card2': 'card2' is not"
    ):
        allocated_cards({"PCIDEVICE_IBM_COM_SPYRE_PF": "0000:1a:00.0,card2"})


def test_spyre_needs_as_many_cards_as_tensor_parallel_workers():
    line = describe_cards(TWO, 2, "sendnn")
    assert line == (
        "2 card(s) from the device plugin, for the tensor-parallel workers: "
        "PCIDEVICE_IBM_COM_SPYRE_PF=0000:1a:00.0,0000:1b:00.0"
    )
    with pytest.raises(ContractError) as e:
        describe_cards(TWO, 4, "sendnn")
    assert str(e.value) == (
        "--tensor-parallel-size=4 needs 4 cards; the device plugin gave this pod 2 "
        "(PCIDEVICE_IBM_COM_SPYRE_PF=0000:1a:00.0,0000:1b:00.0)"
    )


def test_cpu_backends_say_what_they_were_given_and_use_none():
    assert describe_cards(TWO, 4, "eager").startswith("2 card(s) from the device plugin, unused by the eager")
    assert describe_cards({}, 1, "inductor") == "no cards: the inductor backend runs on the CPU"
    assert "PCIDEVICE_IBM_COM_*" in describe_cards({}, 1, "sendnn")


def run_cli(*args, env):
    import os
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "spyre_runtime.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )


def test_serve_names_its_cards_at_start_up_and_stops_on_spyre_with_too_few(tiny_model, tmp_path):
    one = {"PCIDEVICE_IBM_COM_SPYRE_PF": "0000:1a:00.0", "SENDNN_INFERENCE_DYNAMO_BACKEND": "sendnn"}
    res = run_cli("serve", str(tiny_model), "--tensor-parallel-size", "2", "--port", "1", env=one)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == (
        "spyre-runtime: error: --tensor-parallel-size=2 needs 2 cards; the device plugin gave this pod 1 "
        "(PCIDEVICE_IBM_COM_SPYRE_PF=0000:1a:00.0)"
    )
    prompts = tmp_path / "p.json"
    prompts.write_text('{"prompt": "hi"}\n')
    eager = {**one, "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager", "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": "2"}
    res = run_cli("generate", str(tiny_model), "--prompts", str(prompts), env=eager)
    assert res.returncode == 0, res.stderr
    said = "1 card(s) from the device plugin, unused by the eager backend: PCIDEVICE_IBM_COM_SPYRE_PF="
    assert said + "0000:1a:00.0" in res.stderr
