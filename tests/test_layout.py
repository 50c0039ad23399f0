"""The sizes we hold the product code to (shared/STYLE.md, round 3): a module a reader can hold in mind, a
function that fits on a screen, a class that is one concept. The import rules (layers, no circles) are
import-linter contracts in pyproject.toml, run by `make test` before pytest."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime/spyre_runtime", "operator/spyre_operator", "contract/spyre_contract")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 300


def product_modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def oversized(path: Path) -> list[str]:
    """Every module, function and class of `path` over its limit, as 'where: N lines (limit L)'."""
    text = path.read_text()
    rel = path.relative_to(REPO)
    found = []
    num_lines = len(text.splitlines())
    if num_lines > MAX_MODULE_LINES:
        found.append(f"{rel}: {num_lines} lines (limit {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            limit, kind = MAX_FUNCTION_LINES, "function"
        elif isinstance(node, ast.ClassDef):
            limit, kind = MAX_CLASS_LINES, "class"
        else:
            continue
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        size = node.end_lineno - first + 1
        if size > limit:
            found.append(f"{rel}:{node.lineno} {kind} {node.name}: {size} lines (limit {limit})")
    return found


def test_the_layout_checker_sees_an_oversized_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    bad = REPO / "tests" / "_layout_probe.py"
    try:
        bad.write_text(f"def long():\n{body}\n")
        assert [m.split(" ", 1)[1] for m in oversized(bad)] == [
            f"function long: {MAX_FUNCTION_LINES + 1} lines (limit {MAX_FUNCTION_LINES})"
        ]
    finally:
        bad.unlink(missing_ok=True)


@pytest.mark.parametrize("path", product_modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_module_function_and_class_sizes(path):
    assert oversized(path) == []
