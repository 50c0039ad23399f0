"""Writes the SpyreModel API reference (docs/reference/spyremodel.md) from the CRD (crds/spyremodels.yaml).

Every field of the schema, by its full path: its type, whether it is required, its default, its description,
its bounds (enum, pattern, minimum and maximum, lengths, counts) and the rules the API server enforces at
apply time (the CEL rules of `x-kubernetes-validations`, with their messages). Pure: the same CRD always
gives the same page, so a test can hold the checked-in page to the CRD.

    .venv/bin/python scripts/crd_reference.py            # regenerate the page
    .venv/bin/python scripts/crd_reference.py --check    # exit 1 when the checked-in page is stale
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
CRD = REPO / "crds" / "spyremodels.yaml"
PAGE = REPO / "docs" / "reference" / "spyremodel.md"
COMMAND = ".venv/bin/python scripts/crd_reference.py"

# bounds of a schema node, in the order they are shown, with their labels
BOUNDS = (
    ("minimum", "minimum"),
    ("exclusiveMinimum", "exclusive minimum"),
    ("maximum", "maximum"),
    ("exclusiveMaximum", "exclusive maximum"),
    ("multipleOf", "multiple of"),
    ("minLength", "minimum length"),
    ("maxLength", "maximum length"),
    ("minItems", "minimum items"),
    ("maxItems", "maximum items"),
    ("minProperties", "minimum entries"),
    ("maxProperties", "maximum entries"),
)


@dataclass
class Field:
    """One node of the schema as the page shows it."""

    path: str
    node: dict
    required: bool
    rules: list[dict] = field(default_factory=list)


def code(text: object) -> str:
    """`text` as an inline code span, fenced with more backticks than it contains."""
    text = str(text)
    ticks = "`" * (max((len(m) for m in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def fence(text: str, lang: str = "text") -> list[str]:
    """`text` as a fenced block, fenced with more backticks than any run it contains."""
    ticks = "`" * max(3, max((len(m) for m in re.findall(r"`+", text)), default=0) + 1)
    return [f"{ticks}{lang}", *text.splitlines(), ticks]


def prose(text: str) -> str:
    """A description as one Markdown line: whitespace folded, code spans kept, and outside them the
    characters Markdown would read as markup escaped."""
    text = " ".join(str(text).split())
    parts = re.split(r"(`[^`]*`)", text)
    for i in range(0, len(parts), 2):
        part = re.sub(r"([\\*\[\]<>])", r"\\\1", parts[i])
        parts[i] = re.sub(r"(?<!\w)_|_(?!\w)", r"\\_", part)
    return "".join(parts)


def literal(value: object) -> str:
    """A default or enum value as YAML would spell it, in code."""
    return code(value if isinstance(value, str) else json.dumps(value))


def title(path: str) -> str:
    """A field's heading: its path; an array's items and a map's values say so."""
    if path.endswith("[]"):
        return f"{code(path)} (each item)"
    if path.endswith("[key]"):
        return f"{code(path)} (each value)"
    return code(path)


def anchor(path: str) -> str:
    """The id MkDocs (Python-Markdown's toc) and GitHub both give the field's heading."""
    text = title(path).replace("`", "")
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def type_of(node: dict) -> str:
    """The node's type in words."""
    if node.get("x-kubernetes-int-or-string"):
        return "integer or string"
    kind = node.get("type")
    if kind == "array":
        items = node.get("items", {})
        inner = "objects" if items.get("type") == "object" else type_of(items)
        return f"array of {inner}"
    if kind == "object":
        if "additionalProperties" in node:
            return f"map of string to {type_of(node['additionalProperties'])}"
        if node.get("x-kubernetes-preserve-unknown-fields") and "properties" not in node:
            return "object (free-form: its fields are not checked by this schema)"
        return "object"
    if kind is None:
        return "any"
    return f"{kind} ({node['format']})" if "format" in node else kind


def bounds_of(node: dict) -> list[str]:
    return [f"{label} {node[key]}" for key, label in BOUNDS if key in node]


def walk(node: dict, path: str, required: bool, out: list[Field]) -> None:
    """Every node below `node` in schema order, depth first; array items and map values with their own
    properties, bounds or rules get an entry of their own (`path[]`, `path[key]`)."""
    out.append(Field(path, node, required, list(node.get("x-kubernetes-validations", []))))
    needed = set(node.get("required", []))
    for name, child in node.get("properties", {}).items():
        walk(child, f"{path}.{name}" if path else name, name in needed, out)
    for key, suffix in (("items", "[]"), ("additionalProperties", "[key]")):
        inner = node.get(key)
        if isinstance(inner, dict) and ("properties" in inner or "x-kubernetes-validations" in inner):
            walk(inner, path + suffix, False, out)


def summary(fields: list[Field]) -> list[str]:
    lines = ["| field | type | default | required | rules |", "|---|---|---|---|---|"]
    for f in fields:
        default = literal(f.node["default"]) if "default" in f.node else ""
        lines.append(
            f"| [{code(f.path)}](#{anchor(f.path)}) | {type_of(f.node)} | {default} | "
            f"{'yes' if f.required else ''} | {len(f.rules) or ''} |"
        )
    return lines


def inner_facts(inner: dict) -> list[str]:
    """The bounds of an array's items or a map's values, when the page gives them no entry of their own."""
    facts = bounds_of(inner)
    if "enum" in inner:
        facts.append("one of " + ", ".join(literal(v) for v in inner["enum"]))
    if "pattern" in inner:
        facts.append(f"pattern {code(inner['pattern'])}")
    return facts


def rule_lines(path: str, rule: dict) -> list[str]:
    reported = (path + rule.get("fieldPath", "")).lstrip(".") or "the object as a whole"
    lines = [f"Rule (CEL), reported on {code(reported)}:", "", *fence(rule["rule"].strip())]
    if "message" in rule:
        lines += ["", f"Message: {prose(rule['message'])}"]
    if "messageExpression" in rule:
        expression = rule["messageExpression"].strip()
        lines += ["", "Message expression (the message when it evaluates):", "", *fence(expression)]
    if "reason" in rule:
        lines += ["", f"Reason: {code(rule['reason'])}"]
    return [*lines, ""]


def detail(f: Field) -> list[str]:
    node = f.node
    lines = [f"### {title(f.path)}", ""]
    if "description" in node:
        lines += [prose(node["description"]), ""]
    facts = [f"- Type: {type_of(node)}", f"- Required: {'yes' if f.required else 'no'}"]
    if "default" in node:
        facts.append(f"- Default: {literal(node['default'])}")
    if "enum" in node:
        facts.append("- Allowed values: " + ", ".join(literal(v) for v in node["enum"]))
    if bounds := bounds_of(node):
        facts.append("- Bounds: " + ", ".join(bounds))
    if node.get("required"):
        facts.append("- Required fields: " + ", ".join(code(name) for name in node["required"]))
    for key, what in (("items", "Each item"), ("additionalProperties", "Each value")):
        inner = node.get(key)
        if isinstance(inner, dict) and (extra := inner_facts(inner)):
            facts.append(f"- {what}: " + ", ".join(extra))
    lines += [*facts, ""]
    if "pattern" in node:
        lines += ["Pattern (a regular expression the value must match):", "", *fence(node["pattern"]), ""]
    for rule in f.rules:
        lines += rule_lines(f.path, rule)
    return lines


def render(crd: dict) -> str:
    """The reference page for `crd` (a CustomResourceDefinition as a dict)."""
    spec, names = crd["spec"], crd["spec"]["names"]
    lines = [
        f"# {names['kind']} API reference",
        "",
        "<!-- Generated by scripts/crd_reference.py from crds/spyremodels.yaml: do not edit by hand. "
        f"Regenerate with `{COMMAND}`. -->",
        "",
        f"Group {code(spec['group'])}, kind {code(names['kind'])} (list {code(names['listKind'])}), "
        f"plural {code(names['plural'])}, short names "
        + ", ".join(code(n) for n in names.get("shortNames", []))
        + f", scope {spec['scope']}. Generated from {code('crds/spyremodels.yaml')}; "
        f"regenerate with {code(COMMAND)} after changing the CRD (`make test` fails while this page "
        "differs).",
        "",
        "What the API server enforces when a SpyreModel is applied: the schema below (types, allowed values, "
        "patterns, bounds, required fields) and the CEL rules listed under each field. CEL rules need "
        "Kubernetes 1.29 or later; the operator checks every one of them again, so on older clusters the "
        "same spec is refused with condition `Stalled` (reason `InvalidSpec`) instead of at apply time.",
        "",
    ]
    for version in spec["versions"]:
        lines += version_section(version, names["kind"], len(spec["versions"]) > 1)
    return "\n".join(lines).rstrip() + "\n"


def version_section(version: dict, kind: str, several: bool) -> list[str]:
    schema = version["schema"]["openAPIV3Schema"]
    fields: list[Field] = []
    walk(schema, "", False, fields)
    root, fields = fields[0], fields[1:]
    anchors = [anchor(f.path) for f in fields]
    if len(set(anchors)) != len(anchors):
        raise ValueError(
            f"two fields share a heading id: {sorted(a for a in anchors if anchors.count(a) > 1)}"
        )
    level = "###" if several else "##"
    lines = [f"## Version {version['name']}", ""] if several else []
    subresources = ", ".join(code(s) for s in version.get("subresources", {}))
    lines += [
        f"{code(version['name'])}: served {str(version.get('served')).lower()}, "
        f"storage {str(version.get('storage')).lower()}; subresources {subresources or 'none'}.",
        "",
    ]
    if scale := version.get("subresources", {}).get("scale"):
        lines += [
            "The scale subresource reads "
            + ", ".join(f"{key} {code(value)}" for key, value in scale.items())
            + " (what `kubectl scale`, HPA and KEDA use).",
            "",
        ]
    if columns := version.get("additionalPrinterColumns"):
        lines += [f"{level} Columns of `kubectl get`", "", "| column | type | value |", "|---|---|---|"]
        lines += [f"| {c['name']} | {c['type']} | {code(c['jsonPath'])} |" for c in columns]
        lines += [""]
    count = sum(len(f.rules) for f in [root, *fields])
    lines += [
        f"{level} Fields at a glance",
        "",
        f"{len(fields)} fields, {count} CEL rules. The rules column counts the rules declared on the field.",
        "",
        *summary(fields),
        "",
    ]
    if root.rules or root.node.get("required"):
        lines += [f"{level} The {kind} as a whole", ""]
        lines += [f"Required fields: {', '.join(code(n) for n in root.node.get('required', []))}.", ""]
        for rule in root.rules:
            lines += rule_lines("", rule)
    lines += [f"{level} Fields", ""]
    for f in fields:
        lines += detail(f)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crd", type=Path, default=CRD)
    parser.add_argument("--out", type=Path, default=PAGE)
    parser.add_argument("--check", action="store_true", help="fail when --out differs from the CRD's page")
    args = parser.parse_args(argv)
    page = render(yaml.safe_load(args.crd.read_text()))
    if args.check:
        if not args.out.exists() or args.out.read_text() != page:
            print(f"{args.out} differs from what {args.crd} gives: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page)
    print(f"wrote {args.out} ({len(page.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
