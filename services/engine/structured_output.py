"""What a request's output must match (a JSON schema, any JSON object, a regex, a Lark grammar).

Plain data, no torch and no grammar engine: it crosses every hop inside ``SamplingParams``
(the queue's JSON, the worker protos) as the user's own text, and each process that needs
the grammar compiles it from that text (``grammar.py``, cached by ``key``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from services.errors import InvalidRequestError

# json_schema: spec is the schema as JSON text; json_object: any JSON object (spec unused);
# regex: spec is the regular expression the whole output matches; grammar: a Lark grammar
# (llguidance's dialect: EBNF with regex terminals, `start` the top rule)
KINDS = ("json_schema", "json_object", "regex", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    kind: str
    spec: str = ""
    # Output tokens generated before this hop (a request resumed on another decode worker):
    # the matcher consumes them before it constrains anything
    replay: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.replay, tuple):
            object.__setattr__(self, "replay", tuple(self.replay or ()))
        if any(isinstance(t, bool) or not isinstance(t, int) for t in self.replay):
            raise InvalidRequestError("structured replay must be token ids", param="response_format")
        if self.kind not in KINDS:
            raise InvalidRequestError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}",
                                      param="response_format")
        if not isinstance(self.spec, str):
            raise InvalidRequestError(f"the {self.kind} must be a string", param="response_format")
        if self.kind != "json_object" and not self.spec.strip():
            raise InvalidRequestError(f"the {self.kind} is empty", param="response_format")

    @classmethod
    def coerce(cls, value: "StructuredOutput | dict | None") -> "StructuredOutput | None":
        """From a queue message's JSON (a dict) or as is."""
        if value is None or isinstance(value, StructuredOutput):
            return value
        if not isinstance(value, dict) or set(value) - {"kind", "spec", "replay"}:
            raise InvalidRequestError(f"structured must be an object with kind and spec, got {value!r}",
                                      param="response_format")
        return cls(**value)

    @classmethod
    def json_schema(cls, schema: dict | bool) -> "StructuredOutput":
        # key order kept: properties are generated in the schema's order
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))

    @property
    def key(self) -> str:
        """The compile cache's key."""
        return hashlib.sha256(f"{self.kind}\0{self.spec}".encode()).hexdigest()
