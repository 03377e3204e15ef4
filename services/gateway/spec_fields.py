"""Every request field of OpenAI's API for the endpoints pdserve serves: honoured, or refused with a 400 naming it.

One table per endpoint, the fields of OpenAI's published OpenAPI document
(``tests/openai_spec/``; a test fails when the document has a field this table
lacks). Three kinds:

    honoured       pdserve does what OpenAI documents (protocol.py / responses_api.py parse it)
    informational  accepted; by OpenAI's own description it does not change the output
                   (``user``, ``safety_identifier``...)
    refused        a 400 naming the field, unless it is absent, null, empty, or one of the
                   listed values (OpenAI's default, or "off"): clients that send the default
                   keep working, and nobody gets a silently ignored feature

``docs/openai-api.md`` is ``markdown()`` of these tables (a test keeps them equal), and
pdserve's own OpenAPI document (openapi_doc.py) lists the honoured and informational
fields with their ``schema``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from services.errors import InvalidRequestError

HONOURED, INFORMATIONAL, REFUSED = "honoured", "informational", "refused"

_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_INT = {"type": "integer"}
_NUM = {"type": "number"}
_STOP = {"anyOf": [_STR, {"type": "array", "items": _STR, "maxItems": 16}]}
_META = {"type": "object", "additionalProperties": {"type": "string", "maxLength": 512}, "maxProperties": 16}
_SESSION = {"type": "string", "maxLength": 256}
_RESPONSE_FORMAT = {"oneOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "json_schema"], "properties": {
        "type": {"enum": ["json_schema"]},
        "json_schema": {"type": "object", "required": ["name", "schema"], "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": _STR,
            "schema": {"type": "object"}, "strict": {"type": "boolean"}}}}}]}
_SESSION_NOTE = ("session affinity: requests with the same key go to the same decode worker while it is healthy and "
                 "not overloaded, unless another worker holds more of the prompt (header X-Session-ID: the same; "
                 "up to 256 bytes)")


@dataclass(frozen=True)
class SpecField:
    status: str
    note: str = ""
    schema: dict = field(default_factory=dict)  # honoured / informational: what pdserve accepts
    accepts: tuple = ()  # refused: values that are still accepted

    def refuses(self, value: Any) -> bool:
        if self.status != REFUSED or value is None or value == [] or value == {}:
            return False
        return not any(type(value) is type(ok) and value == ok for ok in self.accepts)


def _h(note: str, schema: dict) -> SpecField:
    return SpecField(HONOURED, note, schema)


def _i(note: str, schema: dict) -> SpecField:
    return SpecField(INFORMATIONAL, note, schema)


def _r(note: str, *accepts: Any) -> SpecField:
    return SpecField(REFUSED, note, accepts=accepts)


_SAMPLING = {
    "model": _h("a served model's name (`--model`, repeatable; absent: the first), `auto` (the cascade over "
                "`--cascade` tiers; the response's `model` names the tier that answered; without `--cascade` a "
                "400), or a LoRA adapter's (`NAME` or `<base>:NAME`, served with `--lora`); an unknown "
                "`<base>:NAME` is a 400 naming the adapters served, any other unknown name a 404", _STR),
    "temperature": _h("0 is greedy; OpenAI's default 1", {**_NUM, "minimum": 0, "maximum": 2}),
    "top_p": _h("", {**_NUM, "exclusiveMinimum": 0, "maximum": 1}),
    "stream": _h("server-sent events, each with an id: (resume with Last-Event-ID)", _BOOL),
}
_PENALTIES = {
    "seed": _h("per-request generator: the same seed gives the same tokens", _INT),
    "stop": _h("up to 16 strings; the output ends before the first", _STOP),
    "presence_penalty": _h("", {**_NUM, "minimum": -2, "maximum": 2}),
    "frequency_penalty": _h("", {**_NUM, "minimum": -2, "maximum": 2}),
    "n": _h("choices per request, 1 to the gateway's `--max-n` (default 8; above is a 400): one request, its prompt "
            "computed once and forked into the choices (choice i seeded with seed + i); the gRPC API's "
            "GenerateRequest.n the same",
            {**_INT, "minimum": 1, "maximum": 8}),
    "stream_options": _h("include_usage (a last chunk with usage); include_obfuscation true is a 400 "
                         "(pdserve never pads chunks)",
                         {"type": "object", "properties": {"include_usage": _BOOL, "include_obfuscation": _BOOL}}),
    "logit_bias": _h("token id -> bias in [-100, 100] added to its logit before sampling (greedy and "
                     "structured output too; a token the grammar forbids stays forbidden); an id outside the "
                     "vocabulary or a bias outside the range is a 400",
                     {"type": "object", "additionalProperties": {**_NUM, "minimum": -100, "maximum": 100}}),
    "user": _i("an end-user id; recorded nowhere, changes nothing", _STR),
}

CHAT_FIELDS: dict[str, SpecField] = {
    "messages": _h("text content (a string or text parts); roles system, developer (as system), user, "
                   "assistant (with tool_calls), tool; other part types are a 400",
                   {"type": "array", "minItems": 1}),
    **_SAMPLING, **_PENALTIES,
    "max_tokens": _h("deprecated alias of max_completion_tokens", {**_INT, "minimum": 1}),
    "max_completion_tokens": _h("default: until the context is full", {**_INT, "minimum": 1}),
    "logprobs": _h("the chosen token's logprob, every token the first included", _BOOL),
    "top_logprobs": _h("0-20 alternatives per token (needs logprobs)", {**_INT, "minimum": 0, "maximum": 20}),
    "response_format": _h("text; json_object (any JSON object); json_schema (name, schema, strict): the "
                          "output is guaranteed to parse and validate (a grammar mask on every token; strict "
                          "false is enforced too); a schema that does not compile is a 400 before queueing; "
                          "max_tokens reached mid-object ends with finish_reason length",
                          _RESPONSE_FORMAT),
    "safety_identifier": _i("an end-user id for abuse detection; changes nothing", _STR),
    "prompt_cache_key": _h(_SESSION_NOTE, _SESSION),
    "metadata": _i("tags for stored completions; pdserve stores none (store true is a 400)", _META),
    "parallel_tool_calls": _h("false: at most one call (required: exactly one)", _BOOL),
    "store": _r("stored chat completions are not implemented", False),
    "service_tier": _r("one tier per API key here (x-pdserve-priority)", "auto", "default"),
    "tools": _h("function tools: rendered by the chat template where it renders tools, else as a system "
                "message; calls in Hermes' <tool_call> format, returned as tool_calls with finish_reason "
                "tool_calls; a parameters schema that does not compile is a 400 naming it",
                {"type": "array", "items": {"type": "object", "required": ["function"], "properties": {
                    "type": {"enum": ["function"]}, "function": {"type": "object", "required": ["name"],
                                                                 "properties": {"name": _STR, "description": _STR,
                                                                                "parameters": {"type": "object"}}}}}}),
    "tool_choice": _h("none; auto (the model's calls parsed out of its text); required (a grammar: one or more "
                      "calls); a named function (a grammar: that function's parameter schema); an unknown name "
                      "is a 400",
                      {"anyOf": [{"enum": ["none", "auto", "required"]}, {"type": "object", "properties": {
                          "type": {"enum": ["function"]}, "function": {"type": "object", "properties": {
                              "name": _STR}}}}]}),
    "functions": _r("tool calling is not implemented yet"),
    "function_call": _r("tool calling is not implemented yet", "none", "auto"),
    "audio": _r("text only"),
    "modalities": _r("text only", ["text"]),
    "prediction": _r("predicted outputs are not implemented"),
    "reasoning_effort": _r("the served models do not reason", "none"),
    "verbosity": _r("no verbosity control", "medium"),
    "web_search_options": _r("no web search"),
    "moderation": _r("no moderation"),
    "prompt_cache_options": _r("the prefix cache has no per-request options"),
    "prompt_cache_retention": _r("the prefix cache has no per-request retention"),
}

COMPLETION_FIELDS: dict[str, SpecField] = {
    "prompt": _h("a string or token ids, one prompt per request", {"anyOf": [
        _STR, {"type": "array", "items": {**_INT, "minimum": 0}, "minItems": 1},
        {"type": "array", "items": {"anyOf": [_STR, {"type": "array", "items": _INT}]}, "maxItems": 1}]}),
    **_SAMPLING, **_PENALTIES,
    "max_tokens": _h("OpenAI's default 16", {**_INT, "minimum": 1}),
    "logprobs": _h("0-20: the chosen token's logprob and that many alternatives, with text_offset",
                   {**_INT, "minimum": 0, "maximum": 20}),
    "best_of": _h("candidates generated (n to `--max-n`), the n with the highest cumulative logprob returned; "
                  "not with stream (a 400)", {**_INT, "minimum": 1, "maximum": 8}),
    "echo": _r("the prompt is not echoed", False),
    "suffix": _r("no insertion (fill-in-the-middle)", ""),
}

RESPONSE_FIELDS: dict[str, SpecField] = {
    "input": _h("a string, or input messages with text parts (earlier assistant output messages too), "
                "function_call and function_call_output items; other item types are a 400", {"anyOf": [_STR, {"type": "array", "minItems": 1}]}),
    **_SAMPLING,
    "instructions": _h("a system message before the input; not carried into the next response", _STR),
    "max_output_tokens": _h("default: until the context is full", {**_INT, "minimum": 1}),
    "previous_response_id": _h("continue a stored response: its input and output come before this input",
                               _STR),
    "store": _h("true (default): kept in Redis for GET /v1/responses/{id} and previous_response_id "
                "until --response-ttl; false: not kept", _BOOL),
    "metadata": _h("up to 16 string pairs, kept and returned with the response", _META),
    "text": _h("format: text; json_object; json_schema (name, schema, strict): the output is guaranteed to "
               "parse and validate, as chat's response_format (the same grammar path); a schema that does not "
               "compile is a 400 naming text.format",
               {"type": "object", "properties": {"format": {"type": "object", "properties": {
                   "type": {"enum": ["text", "json_object", "json_schema"]}, "name": _STR,
                   "schema": {"type": "object"}, "strict": _BOOL}}}}),
    "stream_options": _h("include_obfuscation true is a 400 (pdserve never pads events)",
                         {"type": "object", "properties": {"include_obfuscation": _BOOL}}),
    "user": _i("an end-user id; changes nothing", _STR),
    "safety_identifier": _i("an end-user id for abuse detection; changes nothing", _STR),
    "prompt_cache_key": _h(_SESSION_NOTE, _SESSION),
    "parallel_tool_calls": _h("false: at most one call (required: exactly one)", _BOOL),
    "max_tool_calls": _i("not enforced beyond parallel_tool_calls", _INT),
    "tools": _h("function tools (name, description, parameters): chat's tool path (prompt, grammar, parser); "
                "calls come back as function_call output items; with tools a stream holds the text until the "
                "output ends; other tool types are a 400",
                {"type": "array", "items": {"type": "object", "required": ["type", "name"], "properties": {
                    "type": {"enum": ["function"]}, "name": _STR, "description": _STR,
                    "parameters": {"type": "object"}}}}),
    "tool_choice": _h("none; auto; required (a grammar: one or more calls); {type: function, name} (a grammar: "
                      "that function's parameters); an unknown name is a 400",
                      {"anyOf": [{"enum": ["none", "auto", "required"]}, {"type": "object", "properties": {
                          "type": {"enum": ["function"]}, "name": _STR}}]}),
    "background": _r("background responses are not implemented", False),
    "conversation": _r("conversations are not implemented; use previous_response_id"),
    "context_management": _r("no context management"),
    "include": _h("[\"message.output_text.logprobs\"]: each output_text part and delta carries its tokens' "
                  "logprobs; any other value is a 400", {"type": "array", "items": {
                      "enum": ["message.output_text.logprobs"]}}),
    "prompt": _r("stored prompt templates are not implemented"),
    "reasoning": _r("the served models do not reason"),
    "service_tier": _r("one tier per API key here (x-pdserve-priority)", "auto", "default"),
    "top_logprobs": _h("0-20 alternatives per token; turns logprobs on, as the include value does",
                       {**_INT, "minimum": 0, "maximum": 20}),
    "truncation": _r("an input over the context is a 400, never truncated", "disabled"),
    "moderation": _r("no moderation"),
    "prompt_cache_options": _r("the prefix cache has no per-request options"),
    "prompt_cache_retention": _r("the prefix cache has no per-request retention"),
}

ENDPOINTS = {"POST /v1/chat/completions": CHAT_FIELDS, "POST /v1/completions": COMPLETION_FIELDS,
             "POST /v1/responses": RESPONSE_FIELDS}


def refuse_unsupported(body: dict, fields: dict[str, SpecField]) -> None:
    """A 400 naming the first refused field that asks for something pdserve does not do."""
    for name, spec in fields.items():
        if name in body and spec.refuses(body[name]):
            allowed = f" (accepted: {', '.join(json.dumps(a) for a in spec.accepts)})" if spec.accepts else ""
            raise InvalidRequestError(f"{name} is not supported by this server: {spec.note}{allowed}", param=name)


def markdown() -> str:
    """The tables as docs/openai-api.md shows them."""
    out = []
    for endpoint, fields in ENDPOINTS.items():
        out += [f"### `{endpoint}`", "", "| field | | what pdserve does |", "|---|---|---|"]
        for name in sorted(fields, key=lambda n: ((HONOURED, INFORMATIONAL, REFUSED).index(fields[n].status), n)):
            spec = fields[name]
            note = spec.note
            if spec.accepts:
                note += f" (accepted: {', '.join(f'`{json.dumps(a)}`' for a in spec.accepts)})"
            out.append(f"| `{name}` | {spec.status} | {note} |")
        out.append("")
    return "\n".join(out)
