"""``response_format`` -> the request's StructuredOutput, and the gateway's check that it compiles.

OpenAI's three forms: ``{"type": "text"}`` (free text), ``{"type": "json_object"}`` (any
JSON object) and ``{"type": "json_schema", "json_schema": {"name", "schema", "strict",
"description"}}``. pdserve always enforces the schema: ``strict: false`` is constrained
too (as in vLLM), since a grammar that allows more than the schema buys nothing.

The gateway compiles each spec (the same llguidance compiler and tokenizer as the workers,
cached by spec hash) on a thread before the request is queued, so an invalid or unsupported
schema is a 400 naming the problem and never reaches a worker.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from services.engine.structured_output import StructuredOutput
from services.errors import InvalidRequestError

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def parse_response_format(value: Any) -> StructuredOutput | None:
    """None for free text; InvalidRequestError naming the field for anything malformed."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError("response_format must be an object", param="response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise InvalidRequestError(f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                                  f"got {kind!r}", param="response_format.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequestError("response_format.json_schema must be an object with name and schema",
                                  param="response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequestError("response_format.json_schema.name must be 1-64 letters, digits, '_' or '-'",
                                  param="response_format.json_schema.name")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequestError("response_format.json_schema.schema must be a JSON schema object",
                                  param="response_format.json_schema.schema")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise InvalidRequestError("response_format.json_schema.strict must be a boolean",
                                  param="response_format.json_schema.strict")
    return StructuredOutput.json_schema(schema)


class GrammarCheck:
    """The gateway's compiler, built at the first structured request (the tokenizer's conversion
    costs about half a second)."""

    def __init__(self, model):
        self._tokenizer = model.tokenizer  # a ServedModel's
        self._vocab_size = model.vocab_size
        self._compiler = None

    def _compile(self, spec: StructuredOutput, param: str) -> None:
        if self._compiler is None:
            from services.engine.grammar import GrammarCompiler

            tok = self._tokenizer
            eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
            self._compiler = GrammarCompiler(tok.backend.to_str(), self._vocab_size or tok.backend.get_vocab_size(),
                                             eos)
        self._compiler.compile(spec, param)

    async def check(self, structured: StructuredOutput | dict | None, param: str) -> None:
        spec = StructuredOutput.coerce(structured)
        if spec is None:
            return
        if self._tokenizer is None:
            raise InvalidRequestError("structured output needs the model's tokenizer; this model has none",
                                      param=param)
        await asyncio.to_thread(self._compile, spec, param)
