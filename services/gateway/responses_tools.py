"""The Responses API's tools, ``tool_choice`` and ``text.format``, on the chat path's code.

The Responses API spells the same things flatter than chat completions::

    tools:        {"type": "function", "name", "description", "parameters", "strict"}
    tool_choice:  "none" | "auto" | "required" | {"type": "function", "name"}
    text.format:  {"type": "text"} | {"type": "json_object"}
                  | {"type": "json_schema", "name", "schema", "strict", "description"}
    input items:  {"type": "function_call", "call_id", "name", "arguments"}    (an earlier call)
                  {"type": "function_call_output", "call_id", "output"}       (its result)

Each is rewritten into chat's shape and handed to ``tools.parse_tools`` /
``response_format.parse_response_format``, so the prompt, the grammar a forced call follows and
the parser of the output are the chat path's; an error names the Responses field
(``tools[0].name``, ``text.format.schema``). Calls come back as ``function_call`` output items
(``output_items``), with ids derived from the request id so a stream, its final Response and
the stored copy agree.
"""

from __future__ import annotations

import json
from typing import Any

from services.errors import InvalidRequestError
from services.gateway import tools
from services.gateway.response_format import parse_response_format
from services.engine.structured_output import StructuredOutput


def _renamed(exc: InvalidRequestError, old: str, new: str) -> InvalidRequestError:
    """The chat path's error, naming the Responses field."""
    param = (exc.param or "").replace(old, new)
    return InvalidRequestError(exc.message.replace(old, new), param=param or None)


def parse_tools(body: dict) -> tuple[list[tools.Tool], tools.ToolChoice | None]:
    raw = body.get("tools")
    chat: dict[str, Any] = {}
    if raw is not None:
        if not isinstance(raw, list):
            raise InvalidRequestError("tools must be an array of function tools", param="tools")
        for i, t in enumerate(raw):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else None
                raise InvalidRequestError(f"tools[{i}]: only function tools are supported (got type "
                                          f"{json.dumps(kind)[:40]})", param=f"tools[{i}]")
        chat["tools"] = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                         for t in raw]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidRequestError('tool_choice must be "none", "auto", "required" or '
                                      '{"type": "function", "name": ...}', param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        chat["tool_choice"] = choice
    if "parallel_tool_calls" in body:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    try:
        return tools.parse_tools(chat)
    except InvalidRequestError as exc:
        raise _renamed(exc, ".function.", ".") from None


def parse_text_format(body: dict) -> StructuredOutput | None:
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise InvalidRequestError("text must be an object", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequestError("text.format must be an object", param="text.format")
    chat = fmt
    if fmt.get("type") == "json_schema":
        chat = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    try:
        return parse_response_format(chat)
    except InvalidRequestError as exc:
        raise _renamed(_renamed(exc, "response_format.json_schema", "text.format"),
                       "response_format", "text.format") from None


def input_item(item: dict, where: str) -> dict | None:
    """An earlier call or its result as a chat message; None for any other item type."""
    kind = item.get("type")
    if kind == "function_call":
        name, arguments = item.get("name"), item.get("arguments", "{}")
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise InvalidRequestError(f"{where}: a function_call needs a name and arguments (a JSON string)",
                                      param=where)
        return {"role": "assistant", "content": tools.render_calls(
            [{"function": {"name": name, "arguments": arguments}}])}
    if kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            raise InvalidRequestError(f"{where}.output must be a string", param=f"{where}.output")
        return {"role": "tool", "content": output}
    return None


def call_item(request_id: str, i: int, call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": f"fc_{request_id}_{i}", "call_id": f"call_{request_id}_{i}",
            "name": call["name"], "arguments": call["arguments"], "status": status}


def split_output(text: str, choice: tools.ToolChoice | None) -> tuple[str | None, list[dict]]:
    """(message text or None, calls) of a finished output; free text when no tool may be called."""
    if choice is None:
        return text, []
    content, calls = tools.parse_output(text, choice)
    return (content if calls else text), calls


def echo(body: dict) -> dict:
    """What a Response repeats of the request: tools, tool_choice, parallel_tool_calls, text.format."""
    fmt = ((body.get("text") or {}).get("format")) or {"type": "text"}
    return {"tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False, "text": {"format": fmt}}
