"""Structured output in the engine: grammar masks in the sampler, per sequence, next to
unconstrained requests; EOS only where the grammar accepts; the disaggregated hand-off."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from services.engine.sampling_params import SamplingParams
from services.engine.structured_output import StructuredOutput
from services.errors import InvalidRequestError
from tests.engine.recording import run_to_completion
from tests.engine.test_disagg_lifecycle import assert_no_leaks, handoff

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "colour": {"type": "string", "enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2}},
    "required": ["name", "age", "colour"], "additionalProperties": False}


def _chat(engine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def _text(engine, outs) -> str:
    return "".join(o.new_text for o in outs)


def test_json_schema_next_to_unconstrained_requests(default_model):
    """One batch: a constrained request (sampled, seeded) between two free ones; the constrained
    output parses and validates, the free ones are the tokens they get alone."""
    engine = default_model
    free = SamplingParams(max_tokens=24, temperature=0)
    prompt_free = _chat(engine, "Tell me about cats.")
    engine.add_request("alone", prompt_free, free)
    alone = [t for o in run_to_completion(engine)["alone"] for t in o.new_token_ids]

    constrained = SamplingParams(max_tokens=120, temperature=0.8, seed=3,
                                 structured=StructuredOutput.json_schema(SCHEMA))
    engine.add_request("free-a", prompt_free, free)
    engine.add_request("json", _chat(engine, "Describe a person as JSON."), constrained)
    engine.add_request("free-b", prompt_free, free)
    outs = run_to_completion(engine)
    doc = json.loads(_text(engine, outs["json"]))
    jsonschema.validate(doc, SCHEMA)
    assert outs["json"][-1].finish_reason == "stop"
    for rid in ("free-a", "free-b"):
        assert [t for o in outs[rid] for t in o.new_token_ids] == alone


def test_regex_and_grammar(default_model):
    engine = default_model
    engine.add_request("re", _chat(engine, "Give me a date."),
                       SamplingParams(max_tokens=30, temperature=0, structured=StructuredOutput("regex", r"20[0-9]{2}-[01][0-9]-[0-3][0-9]")))
    engine.add_request("lark", _chat(engine, "Is the sky blue?"),
                       SamplingParams(max_tokens=30, temperature=1.0, seed=1,
                                      structured=StructuredOutput("grammar", 'start: ("yes" | "no") "!"')))
    outs = run_to_completion(engine)
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", _text(engine, outs["re"]))
    assert _text(engine, outs["lark"]) in ("yes!", "no!")
    assert outs["re"][-1].finish_reason == outs["lark"][-1].finish_reason == "stop"


def test_max_tokens_mid_object_is_length(default_model):
    """Only where no completion fits the budget: "{}" and the end of sequence take 3 tokens."""
    engine = default_model
    engine.add_request("cut", _chat(engine, "JSON please."),
                       SamplingParams(max_tokens=2, temperature=0, structured=StructuredOutput("json_object")))
    outs = run_to_completion(engine)["cut"]
    assert outs[-1].finish_reason == "length"
    assert _text(engine, outs).startswith("{")


STORY = {"type": "object", "properties": {
    "title": {"type": "string"}, "chapters": {"type": "array", "items": {"type": "object", "properties": {
        "heading": {"type": "string"}, "text": {"type": "string"}}, "required": ["heading", "text"]}},
    "rating": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["title", "chapters", "rating"],
    "additionalProperties": False}


@pytest.mark.parametrize("max_tokens", [30, 80])
def test_output_ends_as_a_match_inside_max_tokens(default_model, max_tokens):
    """Unbounded strings and a budget far below what the model would write: near the budget the
    request is steered onto a short completion, so it stops with JSON that validates."""
    engine = default_model
    prompt = _chat(engine, "Write a very long fairy tale with many chapters as JSON.")
    engine.add_request("story", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=3,
                                                       structured=StructuredOutput.json_schema(STORY)))
    engine.add_request("free", prompt, SamplingParams(max_tokens=max_tokens, temperature=0))  # beside it: untouched
    outs = run_to_completion(engine)
    story = outs["story"]
    assert story[-1].finish_reason == "stop", _text(engine, story)
    assert sum(len(o.new_token_ids) for o in story) <= max_tokens
    jsonschema.validate(json.loads(_text(engine, story)), STORY)
    assert outs["free"][-1].finish_reason == "length"
    assert_no_leaks(engine)


def test_closing_path_search_leaves_the_matcher_as_it_was(default_model):
    engine = default_model
    decoding = engine.structured
    matcher = decoding.compiler.matcher(StructuredOutput.json_schema(STORY))
    written = engine.tokenizer.encode('{"title": "The long night of the')
    assert matcher.consume_tokens(written)
    path = decoding.closing.search(matcher, 60)
    assert path is not None and len(path) <= 60
    assert matcher.consume_tokens(path) and matcher.is_accepting()
    text = engine.tokenizer.decode(written + path)
    jsonschema.validate(json.loads(text), STORY)
    assert decoding.closing.search(matcher, 0) == []  # already accepting


def test_invalid_spec_is_refused_and_holds_nothing(default_model):
    engine = default_model
    for spec in (StructuredOutput("json_schema", '{"type": "frob"}'), StructuredOutput("regex", "[0-9")):
        with pytest.raises(InvalidRequestError, match="cannot be compiled") as err:
            engine.add_request("bad", [1, 2, 3], SamplingParams(structured=spec))
        assert err.value.param == "response_format"
        with pytest.raises(InvalidRequestError):
            engine.reserve("bad", [1, 2, 3], SamplingParams(structured=spec))
    assert not engine.requests and engine.block_pool.num_used == 0


@pytest.mark.slow
def test_handoff_constrains_the_first_token():
    """The prefill engine samples the first token under the grammar; the decode engine's matcher
    consumes it and constrains the rest. A regex whose first character the model would never pick
    unconstrained shows the first token was constrained."""
    from services.config import EngineConfig
    from services.engine.engine import Engine

    cfg = EngineConfig(dtype="fp32", kv_cache_bytes=64 << 20)
    prefill, decode = Engine(cfg), Engine(cfg)
    prompt = _chat(prefill, "What is the capital of France?")
    pattern = r"Q[0-9]{3}"
    free = handoff(prefill, decode, "free", prompt, SamplingParams(max_tokens=5, temperature=0))
    assert not prefill.tokenizer.decode(free).startswith("Q")
    tokens = handoff(prefill, decode, "re", prompt,
                     SamplingParams(max_tokens=10, temperature=0, structured=StructuredOutput("regex", pattern)))
    assert re.fullmatch(pattern, prefill.tokenizer.decode(tokens))
    assert_no_leaks(prefill, decode)


def test_a_resumed_request_replays_the_streamed_tokens(default_model):
    """What the router sends after a decode worker died mid-stream: prompt + streamed tokens, the
    streamed tokens as the grammar's replay. The greedy output continues exactly where it was."""
    engine = default_model
    spec = StructuredOutput.json_schema(SCHEMA)
    prompt = _chat(engine, "Describe a person as JSON.")
    engine.add_request("whole", prompt, SamplingParams(max_tokens=80, temperature=0, structured=spec))
    whole = [t for o in run_to_completion(engine)["whole"] for t in o.new_token_ids]
    k = 6
    resumed = StructuredOutput(spec.kind, spec.spec, tuple(whole[:k]))
    engine.add_request("rest", prompt + whole[:k], SamplingParams(max_tokens=80 - k, temperature=0,
                                                                  structured=resumed))
    rest = [t for o in run_to_completion(engine)["rest"] for t in o.new_token_ids]
    assert whole[:k] + rest == whole
    jsonschema.validate(json.loads(engine.tokenizer.decode(whole)), SCHEMA)
    with pytest.raises(InvalidRequestError, match="do not match"):  # tokens the grammar refuses
        engine.add_request("bad", prompt, SamplingParams(structured=StructuredOutput(
            spec.kind, spec.spec, tuple(engine.tokenizer.encode("hello")))))
    assert not engine.requests


def test_logit_bias_steers_greedy_and_constrained_requests(default_model):
    """The real model, greedy: banning the token it would pick changes its answer; inside a grammar
    a bias picks among the allowed branches, and a bias on a forbidden token changes nothing."""
    engine = default_model
    prompt = _chat(engine, "Is the sky blue? Answer yes or no.")
    grammar = StructuredOutput("grammar", 'start: ("yes" | "no") "!"')
    engine.add_request("plain", prompt, SamplingParams(max_tokens=1, temperature=0))
    engine.add_request("free", prompt, SamplingParams(max_tokens=30, temperature=0, structured=grammar))
    first = run_to_completion(engine)
    plain = first["plain"][0].new_token_ids[0]
    answer = _text(engine, first["free"])
    other = "no!" if answer == "yes!" else "yes!"
    other_id = engine.tokenizer.encode(other[:-1])[0]
    banned = engine.tokenizer.encode("Paris")[0]  # never allowed by the grammar
    engine.add_request("plain", prompt, SamplingParams(max_tokens=1, temperature=0, logit_bias={plain: -100}))
    engine.add_request("steered", prompt, SamplingParams(max_tokens=30, temperature=0, structured=grammar,
                                                         logit_bias={other_id: 100, banned: 100}))
    outs = run_to_completion(engine)
    assert outs["plain"][0].new_token_ids[0] != plain
    assert _text(engine, outs["steered"]) == other
    assert_no_leaks(engine)
