"""Compiling structured-output specs into llguidance matchers, once per spec (bounded LRU).

The grammar engine is llguidance (``docs/structure.md`` says why, from
``benchmarks/probes/grammar_engines.py``). It imports no torch, so the gateway validates
a request's schema with the same code and tokenizer the workers constrain with: a spec
the gateway accepted compiles on every worker.

Compiling builds an ``LLMatcher`` in its start state; the cache keeps that one per spec key
and each request gets a ``deep_copy`` (microseconds against the compile's milliseconds).
llguidance drops the GIL while it compiles and computes masks, so callers may do both
from a worker thread.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance

from services.engine.structured_output import StructuredOutput
from services.errors import InvalidRequestError

# JSON as json.dumps writes it. No free whitespace: a small model given the choice can fill
# max_tokens with newlines inside an object that never closes.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}
DEFAULT_CAPACITY = 256


def grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for ``spec`` (not yet checked: compiling checks it)."""
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.spec)
    if spec.kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(spec.spec)
    schema: object = {"type": "object"}
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.spec)
        except ValueError as exc:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}", param="response_format") from exc
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("the JSON schema must be an object", param="response_format")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except ValueError as exc:
        raise InvalidRequestError(f"the JSON schema cannot be used: {exc}", param="response_format") from exc


class GrammarCompiler:
    """Per tokenizer: spec -> compiled matcher, LRU-bounded. Thread-safe."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int] | tuple[int, ...],
                 capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"grammar cache capacity must be >= 1, got {capacity}")
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self.capacity = capacity
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        # built on first use (about half a second for a 49k vocabulary), not at start-up
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                         eos_token=self._eos or None)
            return self._tokenizer

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos)

    def compile(self, spec: StructuredOutput, param: str = "response_format") -> llguidance.LLMatcher:
        """The cached start-state matcher of ``spec`` (do not advance it: ``matcher`` copies it).
        An invalid or unsupported spec raises InvalidRequestError naming ``param`` and the problem."""
        key = spec.key
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return cached
        try:
            text = grammar_text(spec)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{param}: {exc.message}", param=param) from exc
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{param}: the {spec.kind.replace('_', ' ')} cannot be compiled: "
                                      f"{matcher.get_error()}", param=param)
        with self._lock:
            self.misses += 1
            self._cache[key] = matcher
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, spec: StructuredOutput, param: str = "response_format") -> llguidance.LLMatcher:
        """A fresh matcher for one request, in the start state."""
        return self.compile(spec, param).deep_copy()

    def stats(self) -> dict[str, int]:
        return {"grammar_cache_size": len(self._cache), "grammar_cache_hits": self.hits,
                "grammar_cache_misses": self.misses}
