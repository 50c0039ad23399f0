"""The documentation: the SpyreModel API reference is the CRD's (scripts/crd_reference.py), the site
builds with `mkdocs build --strict` (no broken link or anchor, every page in the navigation), and the README
keeps the two commands and points only at pages that exist."""

import functools
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CRD = REPO / "crds" / "spyremodels.yaml"
PAGE = REPO / "docs" / "reference" / "spyremodel.md"


@functools.cache
def generator():
    """scripts/crd_reference.py as a module (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("crd_reference", REPO / "scripts" / "crd_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_reference_page_is_what_the_crd_gives():
    gen = generator()
    expected = gen.render(yaml.safe_load(CRD.read_text()))
    assert PAGE.exists(), f"{PAGE.relative_to(REPO)} is missing: run `{gen.COMMAND}`"
    assert PAGE.read_text() == expected, (
        f"{PAGE.relative_to(REPO)} differs from what crds/spyremodels.yaml gives: the CRD changed, so run "
        f"`{gen.COMMAND}` and commit the page"
    )


def every_path(node: dict, path: str = "") -> list[str]:
    """Every field path of a schema, as the page writes it."""
    found = [path] if path else []
    for name, child in node.get("properties", {}).items():
        found += every_path(child, f"{path}.{name}" if path else name)
    items = node.get("items", {})
    if "properties" in items:
        found += every_path(items, path + "[]")
    return found


def test_the_reference_names_every_field_and_every_rule_of_the_crd():
    crd = yaml.safe_load(CRD.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    page = generator().render(crd)
    for path in every_path(schema):
        assert f"### `{path}`" in page, path
    rules = []

    def collect(node):
        if isinstance(node, dict):
            rules.extend(node.get("x-kubernetes-validations", []))
            for value in node.values():
                collect(value)
        elif isinstance(node, list):
            for value in node:
                collect(value)

    collect(schema)
    assert len(rules) > 40
    for rule in rules:
        assert rule["rule"].strip() in page
        if "message" in rule:
            assert generator().prose(rule["message"]) in page
    assert f"{len(rules)} CEL rules" in page


def test_the_reference_shows_a_new_fields_type_default_bounds_and_rules():
    gen = generator()
    crd = yaml.safe_load(CRD.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["warmupBudget"] = {
        "type": "integer",
        "description": "Seconds a <pod> may spend on *warm-up*.",
        "default": 300,
        "minimum": 10,
        "maximum": 3600,
        "enum": [10, 300, 3600],
        "x-kubernetes-validations": [
            {"rule": "self % 10 == 0", "message": "must be a multiple of 10", "reason": "FieldValueInvalid"}
        ],
    }
    spec.setdefault("required", []).append("warmupBudget")
    page = gen.render(crd)
    assert page != PAGE.read_text()
    entry = page[page.index("### `spec.warmupBudget`") :]
    entry = entry[: entry.index("\n### ")]
    assert r"Seconds a \<pod\> may spend on \*warm-up\*." in entry
    for fact in (
        "- Type: integer",
        "- Required: yes",
        "- Default: `300`",
        "- Allowed values: `10`, `300`, `3600`",
        "- Bounds: minimum 10, maximum 3600",
        "self % 10 == 0",
        "Message: must be a multiple of 10",
        "Reason: `FieldValueInvalid`",
    ):
        assert fact in entry, fact
    assert "| [`spec.warmupBudget`](#specwarmupbudget) | integer | `300` | yes | 1 |" in page


def test_the_generator_check_mode_fails_on_a_stale_page(tmp_path):
    stale = tmp_path / "spyremodel.md"
    stale.write_text(PAGE.read_text().replace("SpyreModel API reference", "SpyreModel API", 1))
    script = str(REPO / "scripts" / "crd_reference.py")
    run = subprocess.run(
        [sys.executable, script, "--check", "--out", str(stale)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 1
    assert "scripts/crd_reference.py" in run.stderr
    ok = subprocess.run([sys.executable, script, "--check"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr


def test_the_site_builds_strictly(tmp_path):
    site = tmp_path / "site"
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert (site / "reference" / "spyremodel" / "index.html").exists()
    assert (site / "reference" / "environment" / "index.html").exists()


def test_the_readme_keeps_the_two_commands_and_links_to_pages_that_exist():
    readme = (REPO / "README.md").read_text()
    assert re.search(r"^make demo\b", readme, re.M) and re.search(r"^make test\b", readme, re.M)
    assert "`.ci/run` runs exactly `make test`" in readme
    assert "make test" in (REPO / ".ci" / "run").read_text()
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert links
    for link in links:
        assert (REPO / link).is_file(), f"README.md links to {link}, which does not exist"
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    pages = set(re.findall(r"[\w/-]+\.md", str(nav)))
    for link in links:
        assert link.removeprefix("docs/") in pages, f"{link} is not in mkdocs.yml's nav"


def test_the_readmes_first_spyremodel_is_the_example_it_names():
    readme = (REPO / "README.md").read_text()
    block = re.search(r"`examples/smollm2.yaml`, the demo's model:\n\n```yaml\n(.*?)```", readme, re.S)
    assert block, "README.md shows no first SpyreModel"
    example = yaml.safe_load((REPO / "examples" / "smollm2.yaml").read_text())
    assert yaml.safe_load(block.group(1)) == example
