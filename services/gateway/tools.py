"""Tool calls: ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` -> a prompt, a constraint and a parser.

The call format is Hermes' (Qwen, Hermes and many fine-tunes use it)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- Prompt: a chat template that renders ``tools`` gets them; one that does not (SmolLM2's)
  gets them from pdserve as a system message, the fallback vLLM and SGLang use (``system_prompt``).
  An assistant message's ``tool_calls`` is rendered in the format above, a ``tool`` message
  as the template renders that role.
- ``tool_choice``:

  ======================  =====================================  ==================================
  none                    no tools in the prompt, free text      content
  auto (the default)      free text                              ``<tool_call>`` blocks parsed out
  required                a JSON array of calls (grammar)        every item a call; parallel_tool_calls
                                                                 false: exactly one
  {"function": {name}}    the function's arguments (grammar,     one call of that function
                          its parameter schema)
  ======================  =====================================  ==================================

  A call the output holds ends the response with ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from services.engine.structured_output import StructuredOutput
from services.errors import InvalidRequestError

NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "named"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
OPEN_TAG = "<tool_call>"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict


@dataclass(frozen=True)
class ToolChoice:
    """What the gateway keeps of a request's tools (RequestRecord.tools): the mode and, named, the name."""

    mode: str  # auto | required | named, ":single" appended when parallel_tool_calls is false
    name: str = ""  # named: the function
    names: tuple[str, ...] = ()  # every tool's name: auto parses calls of these only

    def dumps(self) -> str:
        return json.dumps({"mode": self.mode, "name": self.name, "names": list(self.names)})

    @classmethod
    def loads(cls, text: str) -> "ToolChoice | None":
        if not text:
            return None
        d = json.loads(text)
        return cls(d["mode"], d.get("name", ""), tuple(d.get("names", ())))


def parse_tools(body: dict) -> tuple[list[Tool], ToolChoice | None]:
    """The request's tools and choice; (tools, None) when no tool may be called."""
    raw = body.get("tools")
    if raw is None:
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return [], None
    if not isinstance(raw, list):
        raise InvalidRequestError("tools must be an array of function tools", param="tools")
    tools = [_tool(t, i) for i, t in enumerate(raw)]
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools have duplicate function names", param="tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    choice = body.get("tool_choice", AUTO if tools else NONE)
    if choice is None:
        choice = AUTO if tools else NONE
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise InvalidRequestError('tool_choice must be "none", "auto", "required" or '
                                      '{"type": "function", "function": {"name": ...}}', param="tool_choice")
        if name not in names:
            raise InvalidRequestError(f"tool_choice names function {name!r}, which is not in tools",
                                      param="tool_choice")
        return tools, ToolChoice(NAMED, name, tuple(names))
    if choice not in (NONE, AUTO, REQUIRED):
        raise InvalidRequestError(f'tool_choice must be "none", "auto", "required" or a function, got '
                                  f"{json.dumps(choice)[:40]}", param="tool_choice")
    if choice == NONE or not tools:
        if choice == REQUIRED:
            raise InvalidRequestError("tool_choice required needs at least one tool", param="tool_choice")
        return tools, None
    return tools, ToolChoice(choice + ("" if parallel is not False else ":single"), "", tuple(names))


def _tool(t: Any, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type", "function") != "function":
        raise InvalidRequestError(f'{where} must be an object with type "function"', param=where)
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise InvalidRequestError(f"{where}.function must be an object with a name", param=f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequestError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-'",
                                  param=f"{where}.function.name")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise InvalidRequestError(f"{where}.function.parameters must be a JSON schema object",
                                  param=f"{where}.function.parameters")
    desc = fn.get("description", "")
    if not isinstance(desc, str):
        raise InvalidRequestError(f"{where}.function.description must be a string",
                                  param=f"{where}.function.description")
    return Tool(name, desc, params)


def mode_of(choice: ToolChoice) -> tuple[str, bool]:
    """(none/auto/required/named, parallel calls allowed)."""
    mode, _, single = choice.mode.partition(":")
    return mode, not single


def structured_output(tools: list[Tool], choice: ToolChoice | None) -> StructuredOutput | None:
    """The grammar a call must follow: named -> its parameters; required -> an array of calls."""
    if choice is None:
        return None
    mode, parallel = mode_of(choice)
    if mode == NAMED:
        return StructuredOutput.json_schema(next(t.parameters for t in tools if t.name == choice.name))
    if mode != REQUIRED:
        return None
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutput.json_schema(schema)


def check_schemas(tools: list[Tool], compile_one) -> None:
    """Each function's parameters must compile (``compile_one(spec, param)`` raises naming it)."""
    for i, t in enumerate(tools):
        compile_one(StructuredOutput.json_schema(t.parameters), f"tools[{i}].function.parameters")


def system_prompt(tools: list[Tool]) -> str:
    """The tool list for a template that does not render tools."""
    listing = "\n".join(json.dumps({"type": "function", "function": {
        "name": t.name, "description": t.description, "parameters": t.parameters}}) for t in tools)
    return ("You may call one or more functions to help with the user's request. The functions:\n"
            f"<tools>\n{listing}\n</tools>\n"
            "To call a function, reply with a JSON object with its name and arguments inside "
            "<tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
            "\n</tool_call>")


def render_calls(calls: list[dict]) -> str:
    """An assistant message's tool_calls as the model would have written them."""
    out = []
    for call in calls:
        fn = call.get("function") or {}
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        out.append(f"<tool_call>\n{json.dumps({'name': fn.get('name'), 'arguments': args})}\n</tool_call>")
    return "\n".join(out)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_output(text: str, choice: ToolChoice) -> tuple[str | None, list[dict]]:
    """(content, calls as {"name", "arguments": JSON text}) from a finished output."""
    mode, _ = mode_of(choice)
    if mode == NAMED:
        return None, [{"name": choice.name, "arguments": text}]
    if mode == REQUIRED:
        try:
            items = json.loads(text)
        except ValueError:  # cut by max_tokens mid-array
            return text, []
        return None, [{"name": c["name"], "arguments": json.dumps(c["arguments"])} for c in items]
    calls = []
    for block in _CALL.findall(text):
        try:
            obj = json.loads(block)
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("name") in choice.names:
            calls.append({"name": obj["name"], "arguments": json.dumps(obj.get("arguments", {}))})
    if not calls:
        return text, []
    if not mode_of(choice)[1]:
        calls = calls[:1]
    content = _CALL.sub("", text).strip()
    return content or None, calls
