"""The grammar compiler (no model weights): one compile per spec, a bounded cache, errors naming the problem."""

from __future__ import annotations

import pytest

from services.engine.grammar import GrammarCompiler
from services.engine.sampling_params import SamplingParams
from services.engine.structured_output import StructuredOutput
from services.errors import InvalidRequestError


@pytest.fixture(scope="module")
def compiler(default_tokenizer):
    return GrammarCompiler(default_tokenizer.backend.to_str(), 49152, [default_tokenizer.eos_token_id], capacity=2)


def test_each_spec_compiles_once_and_the_cache_is_bounded(compiler):
    specs = [StructuredOutput("regex", f"a{{{n}}}") for n in (1, 2, 3)]
    first = compiler.matcher(specs[0])
    first.consume_token(compiler.tokenizer.tokenize_str("a")[0])
    again = compiler.matcher(specs[0])  # a fresh copy in the start state, not the advanced one
    assert compiler.stats()["grammar_cache_hits"] == 1 and not again.is_accepting() and first.is_accepting()
    compiler.matcher(specs[1])
    compiler.matcher(specs[2])
    assert compiler.stats()["grammar_cache_size"] == 2
    misses = compiler.misses
    compiler.matcher(specs[0])  # evicted: compiled again
    assert compiler.misses == misses + 1


@pytest.mark.parametrize("spec, says", [
    (StructuredOutput("json_schema", '{"type": "object", "properties": {"a": {"type": "frob"}}}'), "frob"),
    (StructuredOutput("json_schema", "{not json"), "not valid JSON"),
    (StructuredOutput("json_schema", "[1, 2]"), "must be an object"),
    (StructuredOutput("grammar", "start: missing_rule"), "missing_rule"),
])
def test_invalid_specs_name_the_problem(compiler, spec, says):
    with pytest.raises(InvalidRequestError, match=says) as err:
        compiler.matcher(spec, param="sampling.structured")
    assert err.value.param == "sampling.structured"


def test_structured_output_crosses_the_queue_as_json():
    params = SamplingParams(structured={"kind": "regex", "spec": "[a-z]+", "replay": [5, 6]})
    assert params.structured == StructuredOutput("regex", "[a-z]+", (5, 6))
    with pytest.raises(InvalidRequestError, match="kind must be one of"):
        SamplingParams(structured={"kind": "ebnf", "spec": "x"})
    with pytest.raises(InvalidRequestError, match="empty"):
        StructuredOutput("regex", " ")
