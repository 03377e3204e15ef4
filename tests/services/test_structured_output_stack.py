"""Structured output over the real disaggregated stack: openai client -> gateway -> queue -> router
-> prefill worker (first token, constrained) -> KV over UCX -> decode worker (the rest)."""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest
import redis

from proto.pdserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from services.launcher import LocalStack, StackSpec

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
    "continent": {"type": "string", "enum": ["Europe", "Asia", "Africa", "America", "Oceania"]},
    "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 2}},
    "required": ["city", "population", "continent"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def stack(redis_url):
    redis.Redis.from_url(redis_url).flushdb()
    spec = StackSpec(prefill=1, decode=1, dtype="fp32", threads=1, kv_cache_gb=0.25, redis_url=redis_url)
    with LocalStack(spec) as s:
        s.redis_url = redis_url
        yield s


@pytest.fixture(scope="module")
def client(stack):
    from openai import OpenAI

    return OpenAI(base_url=f"http://{stack.gateway_address}/v1", api_key="none", max_retries=0)


def _messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_json_schema_streaming_and_not_next_to_a_free_request(client):
    """Three requests in flight together: json_schema (non-streaming, sampled), json_schema
    streaming, and an unconstrained one; the structured outputs parse and validate."""
    def constrained():
        reply = client.chat.completions.create(model=MODEL, messages=_messages("Describe Paris as JSON."),
                                               response_format=FORMAT, max_tokens=150, temperature=0.7, seed=5)
        return reply.choices[0].message.content, reply.choices[0].finish_reason

    def streamed():
        chunks = list(client.chat.completions.create(model=MODEL, messages=_messages("Describe Tokyo as JSON."),
                                                     response_format=FORMAT, max_tokens=150, temperature=0,
                                                     stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1]

    def free():
        reply = client.chat.completions.create(model=MODEL, messages=_messages("Describe Rome."),
                                               max_tokens=40, temperature=0)
        return reply.choices[0].message.content, reply.choices[0].finish_reason

    with ThreadPoolExecutor(3) as pool:
        jobs = [pool.submit(f) for f in (constrained, streamed, free)]
        (a, fa), (b, fb), (c, _) = [j.result() for j in jobs]
    for text, finish in ((a, fa), (b, fb)):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert c and not c.lstrip().startswith("{")  # the free request was not constrained


def test_json_object_on_completions(client):
    reply = client.completions.create(model=MODEL, prompt="A JSON object describing a dog: ", max_tokens=80,
                                      temperature=0, extra_body={"response_format": {"type": "json_object"}})
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.text), dict)
    else:  # max_tokens mid-object: "length", and the text is a prefix of an object
        assert choice.finish_reason == "length" and choice.text.startswith("{")


def _queued(stack) -> int:
    r = redis.Redis.from_url(stack.redis_url)
    return sum(r.xlen(k) for k in r.scan_iter("pd:{q}:req:*"))


@pytest.mark.parametrize("fmt, named", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}, "frob"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}, "missing"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "yaml"}, "response_format.type"),
])
def test_invalid_schema_is_a_400_naming_it_and_not_queued(stack, client, fmt, named):
    import openai

    before = _queued(stack)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=_messages("hi"), response_format=fmt, max_tokens=5)
    body = err.value.body
    assert body["param"].startswith("response_format")
    assert named in body["message"] or named == body["param"]
    assert _queued(stack) <= before  # an earlier test's entry may be acked meanwhile; none is added


def _generate(stack, **structured):
    async def run():
        async with grpc.aio.insecure_channel(stack.router_address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            req = generate_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
                max_tokens=20, temperature=0, structured=common_pb2.StructuredOutput(**structured)))
            req.chat.messages.append(generate_pb2.ChatMessage(role="user", content="What is the capital of France?"))
            ids, finish = [], None
            async for msg in stub.Generate(req, timeout=120):
                if msg.HasField("chunk"):
                    ids += msg.chunk.token_ids
                else:
                    finish = msg.finish
            return ids, finish
    return asyncio.run(run())


def test_grpc_regex_constrains_the_first_token_across_the_handoff(stack):
    """The model answers this prompt with "The capital..." unconstrained; under the regex its first
    token (sampled on the prefill worker) is "Q", and the decode worker continues the match."""
    from services.engine.tokenizer import Tokenizer
    from services.engine.model_source import model_card

    tok = Tokenizer(model_card(None).tokenizer_dir)
    ids, finish = _generate(stack, kind="regex", spec=r"Q-[0-9]{3}-(yes|no)")
    text = tok.decode(ids)
    assert re.fullmatch(r"Q-[0-9]{3}-(yes|no)", text), text
    assert finish.finish_reason == "stop"
    assert finish.prefill_worker.startswith("prefill-") and finish.decode_worker.startswith("decode-")


def test_grpc_lark_grammar(stack):
    from services.engine.tokenizer import Tokenizer
    from services.engine.model_source import model_card

    ids, finish = _generate(stack, kind="grammar", spec='start: "Answer: " ("Paris" | "Rome") "."')
    assert Tokenizer(model_card(None).tokenizer_dir).decode(ids) in ("Answer: Paris.", "Answer: Rome.")


@pytest.mark.parametrize("kind, spec", [("gbnf", 'root ::= "a"'), ("regex", "[0-9")])
def test_grpc_unsupported_or_invalid_is_invalid_argument(stack, kind, spec):
    with pytest.raises(grpc.RpcError) as err:
        _generate(stack, kind=kind, spec=spec)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert kind in err.value.details()


# ---- tool calls ---------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = _messages("What is the weather in Paris?")


def _check_call(call, tools=(WEATHER, TIME)):
    fn = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])
    assert call.type == "function" and call.id.startswith("call_")


def test_named_function_call(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    _check_call(call)


def test_named_function_call_streams_incremental_arguments(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=60, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) > 1  # the arguments arrive in pieces
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].type == "function"
    assert all(d.index == 0 for d in deltas) and not any(d.id for d in deltas[1:])
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_required_single_call(client, stream):
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                  parallel_tool_calls=False, max_tokens=80)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls, finish = choice.message.tool_calls, choice.finish_reason
    else:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        calls = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    assert finish == "tool_calls" and len(calls) == 1
    _check_call(calls[0])


def test_a_conversation_with_tool_results(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                           max_tokens=30, temperature=0)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
    assert reply.usage.prompt_tokens > 60  # the call and its result are in the prompt


@pytest.mark.parametrize("extra, param", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tools_are_a_400_naming_the_field(stack, client, extra, param):
    import openai

    before = _queued(stack)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, extra_body=extra)
    assert err.value.body["param"] == param
    assert _queued(stack) <= before  # an earlier test's entry may be acked meanwhile; none is added


# ---- sampling surface: logit_bias, logprobs across the hand-off, the Responses API -------------------


def _token_id(text: str) -> int:
    from services.engine.model_source import model_card
    from services.engine.tokenizer import Tokenizer

    (tid,) = Tokenizer(model_card(None).tokenizer_dir).encode(text)
    return tid


def test_logit_bias_on_chat_and_completions(client):
    ask = _messages("What is the capital of France?")
    plain = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=1, temperature=0, logprobs=True)
    first = plain.choices[0].logprobs.content[0].token
    banned = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=1, temperature=0, logprobs=True,
                                            logit_bias={str(_token_id(first)): -100})
    assert banned.choices[0].logprobs.content[0].token != first
    yes = _token_id(" yes")
    forced = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0,
                                       logit_bias={str(yes): 100})
    assert forced.choices[0].text == " yes yes yes"


def test_logit_bias_over_grpc_reaches_the_prefill_worker(stack):
    """The first token is sampled on the prefill worker, the rest on the decode worker: both biased."""
    yes = _token_id(" yes")

    async def run():
        async with grpc.aio.insecure_channel(stack.router_address) as channel:
            req = generate_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
                max_tokens=3, temperature=0, logit_bias={yes: 100.0}))
            req.text = "The sky is"
            ids, finish = [], None
            async for msg in generate_pb2_grpc.GenerationStub(channel).Generate(req, timeout=120):
                ids += msg.chunk.token_ids if msg.HasField("chunk") else []
                finish = msg.finish if msg.HasField("finish") else finish
            return ids, finish
    ids, finish = asyncio.run(run())
    assert ids == [yes] * 3 and finish.prefill_worker.startswith("prefill-")


def test_streamed_logprobs_cover_every_token_the_first_included(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=_messages("Name three colours."), max_tokens=12, temperature=0, stream=True,
        logprobs=True, top_logprobs=3, stream_options={"include_usage": True}))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens == 12
    for e in entries:  # greedy: the chosen token is the most likely one
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-4)


def test_responses_api_named_tool_and_text_format(client):
    tool = {"type": "function", **WEATHER["function"]}
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[tool],
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    fmt = {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}
    r = client.responses.create(model=MODEL, input="Describe Paris as JSON.", text={"format": fmt},
                                max_output_tokens=150, temperature=0)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)


def test_responses_api_logprobs(client):
    r = client.responses.create(model=MODEL, input="Name three colours.", max_output_tokens=8, temperature=0,
                                include=["message.output_text.logprobs"], top_logprobs=2)
    part = r.output[0].content[0]
    assert len(part.logprobs) == r.usage.output_tokens and "".join(lp.token for lp in part.logprobs) == part.text
    assert all(lp.top_logprobs[0].logprob == pytest.approx(lp.logprob, abs=1e-4) for lp in part.logprobs)
