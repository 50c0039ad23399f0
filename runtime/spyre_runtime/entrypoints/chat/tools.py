"""Tools on a chat request, as vLLM and OpenAI take them: the checks (each a 400 naming its field), what
`tool_choice` asks for (`ToolPlan`), the grammar that enforces `required` and a named function (so the
arguments always parse and match the function's schema), and the tool calls of earlier assistant messages
as the chat template reads them (arguments as objects, as vLLM passes them).

    tool_choice   none        no tools reach the template; the output is content
                  auto        with --enable-auto-tool-choice: the --tool-call-parser reads calls out of the
                              text, else content (without the flag: the output is content, as before)
                  required    grammar: [{"name": <a tool>, "parameters": <its schema>}, ...] (one item when
                              parallel_tool_calls is false)
                  {function}  grammar: that function's parameters schema; the whole output is its arguments
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from spyre_runtime.entrypoints.chat.protocol import Tool, ToolsBody
from spyre_runtime.entrypoints.chat.tool_parsers import TOOL_PARSERS, RequiredToolParser, ToolParser
from spyre_runtime.entrypoints.server.errors import bad_request

ANY_OBJECT = {"type": "object", "properties": {}}
COMPOSED = ("type", "anyOf", "oneOf", "allOf", "$ref", "enum", "const")


@dataclass(frozen=True)
class ChatSettings:
    """The server's flags on reading chat output: --enable-auto-tool-choice, --tool-call-parser and
    --reasoning-parser."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def new_reasoning_parser(self):
        from spyre_runtime.entrypoints.chat.reasoning import REASONING_PARSERS

        return REASONING_PARSERS[self.reasoning_parser]() if self.reasoning_parser else None


@dataclass(frozen=True)
class ToolPlan:
    """How one request's output is read. mode: "text" (all content), "auto", "required" or "named";
    `parser` reads calls (auto, required); `function` is the named one; `guide` is the grammar to run,
    as Validator.guide takes it: (parameter, kind, schema)."""

    mode: str = "text"
    parser: ToolParser | None = None
    function: str | None = None
    guide: tuple[str, str, Any] | None = None
    parallel: bool = True

    @property
    def needs_special_tokens(self) -> bool:
        return self.parser is not None and self.parser.needs_special_tokens


TEXT = ToolPlan()


def function_schema(tool: Tool) -> dict:
    """A function's parameters as the grammar of its arguments: an object, and (as OpenAI's strict
    function calling) no property the function does not declare, wherever the schema lists properties and
    leaves additionalProperties open. Arguments that fit it fit the function's own schema too."""
    schema = tool.function.parameters
    if not schema:
        return dict(ANY_OBJECT)
    schema = closed_objects(schema)
    if not any(k in schema for k in COMPOSED):
        return {"type": "object", **schema}
    return schema


VALUE_KEYWORDS = frozenset({"enum", "const", "default", "examples", "required"})
MAP_KEYWORDS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def closed_objects(schema):
    """A copy of `schema` with additionalProperties false on every object schema that lists properties
    and says nothing about other ones."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in VALUE_KEYWORDS:
            out[key] = value
        elif key in MAP_KEYWORDS and isinstance(value, dict):
            out[key] = {name: closed_objects(sub) for name, sub in value.items()}
        else:
            out[key] = closed_objects(value)
    if "properties" in out and not {"additionalProperties", "patternProperties"} & out.keys():
        out["additionalProperties"] = False
    return out


def check_tools(tools: list[Tool]) -> None:
    """Each parameters schema is JSON Schema; names are unique."""
    import jsonschema

    seen = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if not name:
            raise bad_request(f"tools.{i}.function.name", "must not be empty")
        if name in seen:
            raise bad_request(f"tools.{i}.function.name", f"{name!r} is given twice")
        seen.add(name)
        params = tool.function.parameters
        if params is None:
            continue
        try:
            jsonschema.validators.validator_for(params, default=jsonschema.Draft202012Validator).check_schema(
                params
            )
        except jsonschema.SchemaError as e:
            where = "/".join(str(p) for p in e.path) or "the top level"
            raise bad_request(
                f"tools.{i}.function.parameters", f"is not a JSON Schema ({e.message} at {where})"
            ) from None


def required_schema(tools: list[Tool], parallel: bool) -> dict:
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "parameters": function_schema(t)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def plan_tools(body: ToolsBody, settings: ChatSettings) -> ToolPlan:
    """What the request's tools and tool_choice ask for; a 400 naming the field when they do not fit."""
    tools = body.tools or []
    choice = body.tool_choice
    parallel = body.parallel_tool_calls is not False
    check_tools(tools)
    if choice is not None and not isinstance(choice, str):
        names = [t.function.name for t in tools]
        wanted = choice.function.name
        if wanted not in names:
            known = f"the tools are {names}" if names else "no tools are given"
            raise bad_request("tool_choice", f"names function {wanted!r}, which is not in tools ({known})")
        i = names.index(wanted)
        guide = (f"tools.{i}.function.parameters", "json_schema", function_schema(tools[i]))
        return ToolPlan("named", function=wanted, guide=guide, parallel=parallel)
    if choice == "required":
        if not tools:
            raise bad_request("tool_choice", "'required' needs tools")
        guide = ("tools", "json_schema", required_schema(tools, parallel))
        return ToolPlan("required", RequiredToolParser(), guide=guide, parallel=parallel)
    if choice == "none" or not tools:
        return TEXT
    if settings.enable_auto_tool_choice and settings.tool_call_parser:
        return ToolPlan("auto", TOOL_PARSERS[settings.tool_call_parser](), parallel=parallel)
    return TEXT


def template_tool_calls(calls: list, where: str) -> list[dict]:
    """An assistant message's tool calls for the chat template: arguments as objects (templates index
    them or iterate their items), as vLLM passes them."""
    out = []
    for j, call in enumerate(calls):
        try:
            arguments = json.loads(call.function.arguments) if call.function.arguments else {}
        except json.JSONDecodeError as e:
            raise bad_request(f"{where}.{j}.function.arguments", f"is not JSON: {e}") from None
        function = {"name": call.function.name, "arguments": arguments}
        out.append({"id": call.id, "type": "function", "function": function})
    return out
