"""The Responses API's tools, tool_choice and text.format with the official ``openai`` client: the chat
path's prompt, grammar and parser underneath, calls returned as function_call items, a call's result
sent back as a function_call_output item."""

from __future__ import annotations

import json

from services.gateway import tools
from tests.gateway.fake_router import Plan

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}


def _pieces(text: str) -> tuple[str, ...]:
    return tuple(text[i:i + 7] for i in range(0, len(text), 7))


def test_auto_call_is_a_function_call_item_and_its_output_goes_back(client):
    h, c = client
    h.router.plan = lambda req: Plan(pieces=_pieces(CALL_TEXT))
    r = c.responses.create(model=h.model.name, input="Weather in Paris?", tools=[WEATHER])
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    assert r.status == "completed" and r.tools[0].name == "get_weather" and r.tool_choice == "auto"
    [queued] = h.router.seen
    assert "structured" not in queued.sampling  # auto: free text, calls parsed out of it
    assert queued.token_ids == h.model.tokenizer.apply_chat_template(
        [{"role": "system", "content": tools.system_prompt([tools.Tool("get_weather", WEATHER["description"],
                                                                       WEATHER["parameters"])])},
         {"role": "user", "content": "Weather in Paris?"}])
    # the client's loop: the call and its output go back as input items
    h.router.plan = lambda req: Plan(pieces=("It is sunny.",))
    follow = c.responses.create(model=h.model.name, tools=[WEATHER], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}])
    assert follow.output_text == "It is sunny."
    prompt = h.model.tokenizer.decode(h.router.seen[1].token_ids)
    assert '{"sky": "sunny"}' in prompt and '"name": "get_weather"' in prompt
    # previous_response_id carries the call in the model's call format too
    c.responses.create(model=h.model.name, input="And Rome?", tools=[WEATHER], previous_response_id=r.id)
    assert "<tool_call>" in h.model.tokenizer.decode(h.router.seen[2].token_ids)


def test_named_tool_choice_is_constrained_to_its_parameters(client):
    h, c = client
    h.router.plan = lambda req: Plan(pieces=('{"city": ', '"Oslo"}'))
    r = c.responses.create(model=h.model.name, input="Weather?", tools=[WEATHER],
                           tool_choice={"type": "function", "name": "get_weather"})
    [call] = r.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Oslo"}
    structured = h.router.seen[0].sampling["structured"]
    assert structured["kind"] == "json_schema" and json.loads(structured["spec"]) == WEATHER["parameters"]


def test_required_calls_and_text_beside_them(client):
    h, c = client
    h.router.plan = lambda req: Plan(pieces=_pieces(
        '[{"name": "get_weather", "arguments": {"city": "Lima"}}, '
        '{"name": "get_weather", "arguments": {"city": "Quito"}}]'))
    r = c.responses.create(model=h.model.name, input="Weather in two cities", tools=[WEATHER], tool_choice="required")
    assert [json.loads(i.arguments)["city"] for i in r.output] == ["Lima", "Quito"]
    assert len({i.call_id for i in r.output}) == 2
    assert h.router.seen[0].sampling["structured"]["kind"] == "json_schema"
    h.router.plan = lambda req: Plan(pieces=_pieces("Let me check. " + CALL_TEXT))
    r = c.responses.create(model=h.model.name, input="Weather?", tools=[WEATHER])
    assert [i.type for i in r.output] == ["message", "function_call"] and r.output_text == "Let me check."


def test_streamed_calls_arrive_as_function_call_events(client):
    h, c = client
    h.router.plan = lambda req: Plan(pieces=_pieces(CALL_TEXT))
    evs = list(c.responses.create(model=h.model.name, input="Weather?", tools=[WEATHER], stream=True))
    types = [e.type for e in evs]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert json.loads(evs[4].arguments) == {"city": "Paris"} and evs[2].item.name == "get_weather"
    assert evs[5].item.call_id == evs[-1].response.output[0].call_id
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    # the SDK's own accumulator agrees
    with c.responses.stream(model=h.model.name, input="Weather?", tools=[WEATHER]) as stream:
        final = stream.get_final_response()
    assert final.output[0].type == "function_call" and json.loads(final.output[0].arguments) == {"city": "Paris"}


def test_tools_without_a_call_stream_the_text_at_the_end(client):
    h, c = client
    evs = list(c.responses.create(model=h.model.name, input="Hi", tools=[WEATHER], stream=True))
    text = "".join(e.delta for e in evs if e.type == "response.output_text.delta")
    assert text == "Hello, world!" and evs[-1].response.output[0].type == "message"


def test_text_format_json_schema_reaches_the_grammar(client):
    h, c = client
    h.router.plan = lambda req: Plan(pieces=('{"answer": ', "42}"))
    fmt = {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}
    r = c.responses.create(model=h.model.name, input="What is 6 x 7?", text={"format": fmt})
    assert json.loads(r.output_text) == {"answer": 42} and r.text.format.type == "json_schema"
    structured = h.router.seen[0].sampling["structured"]
    assert structured["kind"] == "json_schema" and json.loads(structured["spec"]) == SCHEMA
    c.responses.create(model=h.model.name, input="Any JSON", text={"format": {"type": "json_object"}})
    assert h.router.seen[1].sampling["structured"]["kind"] == "json_object"


def test_logprobs_with_include_and_top_logprobs(client):
    h, c = client
    r = c.responses.create(model=h.model.name, input="Hi", include=["message.output_text.logprobs"], top_logprobs=2)
    part = r.output[0].content[0]
    assert [lp.token for lp in part.logprobs] == ["Hello", ",", " wor", "ld", "!"]
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs) and part.logprobs[0].logprob == -0.25
    assert h.router.seen[0].sampling["logprobs"] == 2
    evs = list(c.responses.create(model=h.model.name, input="Hi", top_logprobs=0, stream=True))
    deltas = [e for e in evs if e.type == "response.output_text.delta"]
    assert [[lp.token for lp in e.logprobs] for e in deltas] == [["Hello"], [","], [" wor"], ["ld"], ["!"]]
    assert len(evs[-1].response.output[0].content[0].logprobs) == 5
    plain = c.responses.create(model=h.model.name, input="Hi")
    assert plain.output[0].content[0].logprobs == [] and "logprobs" not in h.router.seen[-1].sampling
