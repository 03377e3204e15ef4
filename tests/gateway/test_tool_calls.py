"""Tool-call parsing and formatting in the gateway (tools.py, openai_format.py): the output a model
wrote -> OpenAI's tool_calls, streamed and not. The real stack's tests are in
tests/services/test_structured_output_stack.py."""

from __future__ import annotations

import json

import pytest

from services.errors import InvalidRequestError
from services.gateway import tools
from services.gateway.openai_format import ResponseAggregate, StreamFormatter
from services.gateway.protocol import parse_chat
from services.gateway.request_record import CHAT, RequestRecord

FN = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def _record(body: dict) -> RequestRecord:
    req = parse_chat({"messages": [{"role": "user", "content": "hi"}], **body})
    return RequestRecord("r1", CHAT, "m", 0, "t", tools=req.tool_choice.dumps() if req.tool_choice else "")


def _stream(record: RequestRecord, pieces: list[str], reason: str = "stop") -> list[dict]:
    fmt = StreamFormatter(record, include_usage=False)
    out = [c for p in pieces for c in fmt.chunk({"text": p, "token_ids": [1]})]
    return out + fmt.final({"finish_reason": reason})


def test_auto_call_is_parsed_out_of_the_text():
    record = _record({"tools": [FN]})
    agg = ResponseAggregate(record)
    agg.add({"text": "Let me add. " + CALL, "token_ids": [1]})
    choice = agg.body({"finish_reason": "stop"})["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me add."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": json.dumps({"a": 1, "b": 2})}


def test_auto_stream_shows_text_before_the_call_and_holds_the_call_back():
    chunks = _stream(_record({"tools": [FN]}), ["Sure. <tool", "_call>\n{\"name\": \"add\", ", CALL[28:]])
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content", "") for d in deltas).strip() == "Sure."
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "add")]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_text_without_a_call_is_content():
    chunks = _stream(_record({"tools": [FN]}), ["1 + 2 ", "is 3 <"])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "1 + 2 is 3 <"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_auto_ignores_calls_of_unknown_functions():
    agg = ResponseAggregate(_record({"tools": [FN]}))
    agg.add({"text": '<tool_call>{"name": "rm", "arguments": {}}</tool_call>', "token_ids": [1]})
    choice = agg.body({"finish_reason": "stop"})["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"


def test_required_parallel_calls_and_length():
    record = _record({"tools": [FN], "tool_choice": "required"})
    two = json.dumps([{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": {"a": 3, "b": 4}}])
    calls = [tc for c in _stream(record, [two[:10], two[10:]]) for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0, 1] and len({c["id"] for c in calls}) == 2
    cut = _stream(record, [two[:10]], reason="length")
    assert cut[-1]["choices"][0]["finish_reason"] == "length"


def test_tool_choice_constrains_the_output():
    named = parse_chat({"messages": [{"role": "user", "content": "x"}], "tools": [FN],
                        "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert json.loads(named.sampling["structured"]["spec"]) == FN["function"]["parameters"]
    single = parse_chat({"messages": [{"role": "user", "content": "x"}], "tools": [FN], "tool_choice": "required",
                         "parallel_tool_calls": False})
    assert json.loads(single.sampling["structured"]["spec"])["maxItems"] == 1
    auto = parse_chat({"messages": [{"role": "user", "content": "x"}], "tools": [FN]})
    assert "structured" not in auto.sampling and auto.tools
    none = parse_chat({"messages": [{"role": "user", "content": "x"}], "tools": [FN], "tool_choice": "none"})
    assert none.tool_choice is None and not none.tools


def test_response_format_and_a_forced_call_conflict():
    with pytest.raises(InvalidRequestError) as err:
        parse_chat({"messages": [{"role": "user", "content": "x"}], "tools": [FN], "tool_choice": "required",
                    "response_format": {"type": "json_object"}})
    assert err.value.param == "response_format"


def test_assistant_tool_calls_are_rendered_in_the_call_format():
    req = parse_chat({"messages": [
        {"role": "user", "content": "add"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "3"}]})
    assert req.messages[1]["content"] == CALL and req.messages[2] == {"role": "tool", "content": "3"}


def test_system_prompt_lists_the_tools():
    text = tools.system_prompt(tools.parse_tools({"tools": [FN]})[0])
    assert '"name": "add"' in text and "<tool_call>" in text
