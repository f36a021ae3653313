"""Tool calls in chat: `tools` with `tool_choice` "required" or a named function, the arguments constrained to the
functions' JSON schemas (as vLLM does for these two choices), and the answer's `tool_calls`.

- a named function (`{"type": "function", "function": {"name": ...}}`): the output is that function's arguments,
  an object valid against its `parameters`; one tool call, finish reason "stop" (as OpenAI answers a forced
  function).
- "required": the output is a non-empty array of `{"name": one of the tools, "parameters": its arguments}`; one
  tool call each, finish reason "tool_calls".
- "none": the tools go to the chat template only; the answer is text.

"auto" (OpenAI's default when tools are given) lets the model choose between text and a call in its own format,
which needs a parser per model family: it is refused with a 400 naming `tool_choice`, never served as text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from mbridge_epoverlap.serving.api.errors import ApiError, shown
from mbridge_epoverlap.serving.decoding.grammar import JSON_SCHEMA

NAMED, REQUIRED = "named", "required"
_ANY_ARGUMENTS = {"type": "object"}


@dataclass(frozen=True)
class ToolChoice:
    """How a request's output becomes tool calls: `kind` NAMED (`name` the function) or REQUIRED."""

    kind: str
    name: str | None
    grammar: tuple[str, str]


def parse(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, ToolChoice | None]:
    """(the tools for the chat template or None, how the output becomes tool calls or None). Raises ApiError."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise ApiError(400, f"'tool_choice' = {shown(choice)} needs 'tools'", param="tool_choice")
        return None, None
    functions = _functions(tools)
    if choice == "none":
        return tools, None
    if choice == REQUIRED:
        items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": params},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, params in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        return tools, ToolChoice(REQUIRED, None, (JSON_SCHEMA, json.dumps(schema)))
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str) or name not in functions:
            raise ApiError(400, f"'tool_choice' names the function {shown(name)}, which is not among 'tools' "
                                f"({', '.join(functions)})", param="tool_choice")
        return tools, ToolChoice(NAMED, name, (JSON_SCHEMA, json.dumps(functions[name])))
    if choice in (None, "auto"):
        raise ApiError(400, "'tool_choice' \"auto\" (the default with 'tools') is not supported by this server: it "
                            "needs the model's own tool-call format; give \"required\", \"none\" or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    raise ApiError(400, f"'tool_choice' must be \"none\", \"required\", \"auto\" or a named function, got "
                        f"{shown(choice)}", param="tool_choice")


def _functions(tools: Any) -> dict[str, Any]:
    """Function name -> its parameters' schema (any object when it gives none)."""
    if not isinstance(tools, list) or not tools:
        raise ApiError(400, "'tools' must be a non-empty list of {\"type\": \"function\", \"function\": {...}}",
                       param="tools")
    functions: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": str, "
                                f"\"parameters\": a JSON schema}}}}", param="tools")
        params = function.get("parameters")
        if params is None:
            params = _ANY_ARGUMENTS
        if not isinstance(params, dict):
            raise ApiError(400, f"'tools[{i}].function.parameters' must be a JSON schema (an object)", param="tools")
        if name in functions:
            raise ApiError(400, f"'tools' names the function {name!r} twice", param="tools")
        functions[name] = params
    return functions


def calls(choice: ToolChoice, text: str) -> list[dict[str, Any]] | None:
    """The `tool_calls` of an output, or None when the output is not a whole call (cut by its token limit)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if choice.kind == NAMED:
        return [_call(choice.name or "", text)]
    if not isinstance(value, list):
        return None
    return [_call(item["name"], json.dumps(item["parameters"])) for item in value]


def finish_reason(choice: ToolChoice) -> str:
    return "stop" if choice.kind == NAMED else "tool_calls"


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}
