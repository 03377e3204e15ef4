"""The Responses API with the official ``openai`` client: create, stream, retrieve, previous_response_id, store."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.gateway.fake_router import DEFAULT_PIECES, Plan

EXPECTED = "".join(DEFAULT_PIECES)


def test_create_with_a_string_input(client):
    h, c = client
    r = c.responses.create(model=h.model.name, input="Say hello", instructions="Be brief.", max_output_tokens=9,
                           temperature=0, top_p=0.5, metadata={"case": "1"})
    assert r.object == "response" and r.status == "completed" and r.output_text == EXPECTED
    assert r.id.startswith("resp_") and r.output[0].role == "assistant" and r.output[0].status == "completed"
    assert (r.instructions, r.max_output_tokens, r.temperature, r.top_p) == ("Be brief.", 9, 0, 0.5)
    assert r.metadata == {"case": "1"}
    [queued] = h.router.seen
    assert r.usage.input_tokens == len(queued.token_ids) and r.usage.output_tokens == len(DEFAULT_PIECES)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # the same chat template path: instructions are a system message before the input
    assert queued.token_ids == h.model.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}])
    assert queued.sampling == {"max_tokens": 9, "temperature": 0, "top_p": 0.5}
    assert c.responses.retrieve(r.id).output_text == EXPECTED  # stored (store defaults to true)


def test_message_list_input_and_previous_response_id(client):
    h, c = client
    first = c.responses.create(model=h.model.name, instructions="Be brief.", input=[
        {"role": "developer", "content": "Answer in English."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}])
    second = c.responses.create(model=h.model.name, input="And again?", previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.output_text == EXPECTED
    # the follow-up saw the earlier input and output, not the earlier instructions
    assert h.router.seen[1].token_ids == h.model.tokenizer.apply_chat_template([
        {"role": "system", "content": "Answer in English."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": EXPECTED}, {"role": "user", "content": "And again?"}])
    third = c.responses.create(model=h.model.name, input="Once more", previous_response_id=second.id)
    assert len(h.router.seen[2].token_ids) > len(h.router.seen[1].token_ids)
    assert third.status == "completed"


def test_store_false_keeps_nothing(client):
    h, c = client
    r = c.responses.create(model=h.model.name, input="Hi", store=False)
    assert r.store is False and r.output_text == EXPECTED
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as err:
        c.responses.create(model=h.model.name, input="Hi", previous_response_id=r.id)
    assert err.value.body["param"] == "previous_response_id"
    assert len(h.router.seen) == 1  # the refused follow-up was never queued


def test_streaming_typed_events(client):
    h, c = client
    stream = c.responses.create(model=h.model.name, input="Say hello", stream=True)
    evs = list(stream)
    types = [e.type for e in evs]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[4:-4] == ["response.output_text.delta"] * len(DEFAULT_PIECES)
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    assert "".join(e.delta for e in evs if e.type == "response.output_text.delta") == EXPECTED
    done = evs[-1].response
    assert done.status == "completed" and done.output_text == EXPECTED and done.usage.output_tokens == 5
    assert evs[0].response.status == "in_progress"
    assert c.responses.retrieve(done.id).status == "completed"


def test_streaming_on_the_wire_has_event_names_and_ids(client):
    h, _ = client
    with httpx.Client(base_url=h.url, timeout=10) as http:
        with http.stream("POST", "/v1/responses", json={"input": "Hi", "stream": True}) as r:
            lines = list(r.iter_lines())
    names = [line.split(": ", 1)[1] for line in lines if line.startswith("event:")]
    ids = [line for line in lines if line.startswith("id:")]
    datas = [json.loads(line[6:]) for line in lines if line.startswith("data:")]
    assert names == [d["type"] for d in datas] and len(ids) == len(datas)
    assert "[DONE]" not in "\n".join(lines)


def test_length_finish_is_incomplete(client):
    h, c = client
    h.router.plan = lambda req: Plan(finish_reason="length")
    r = c.responses.create(model=h.model.name, input="Hi", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    evs = list(c.responses.create(model=h.model.name, input="Hi", max_output_tokens=5, stream=True))
    assert evs[-1].type == "response.incomplete"


def test_a_failure_mid_stream_ends_with_error_and_failed_events(client):
    h, c = client
    h.router.plan = lambda req: Plan(error_after=2)
    evs = list(c.responses.create(model=h.model.name, input="Hi", stream=True))
    assert [e.type for e in evs[-2:]] == ["error", "response.failed"]
    assert evs[-2].message == "decode worker lost"
    failed = evs[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert c.responses.retrieve(failed.id).status == "failed"
    # without streaming: the error's own status, and the stored response says failed
    with pytest.raises(openai.APIStatusError) as err:
        c.responses.create(model=h.model.name, input="Hi")
    assert err.value.status_code == 502


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": ""}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input[0].output"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input[0]"),
    ({"input": [{"role": {"x": 1}, "content": "Hi"}]}, "input[0].role"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "no spaces"}]}, "tools[0].name"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "frob"}}]},
     "tools[0].parameters"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice"),
    ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"input": "Hi", "background": True}, "background"),
    ({"input": "Hi", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "Hi", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "frob"}}}},
     "text.format"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "temperature": -1}, "temperature"),
    ({"input": "Hi", "metadata": {"k": 1}}, "metadata"),
    ({"input": "Hi", "previous_response_id": "resp_nothing"}, "previous_response_id"),
])
def test_bad_requests_are_4xx_naming_the_field(gateway, body, param):
    h = gateway()
    with httpx.Client(base_url=h.url, timeout=10) as http:
        r = http.post("/v1/responses", json=body)
    assert 400 <= r.status_code < 500 and r.json()["error"]["param"] == param, r.text
    assert h.router.seen == []


def test_another_tenants_response_is_not_found(gateway):
    h = gateway(keys={"sk-aaaaaaaa": {"tenant": "a"}, "sk-bbbbbbbb": {"tenant": "b"}})
    a, b = {"Authorization": "Bearer sk-aaaaaaaa"}, {"Authorization": "Bearer sk-bbbbbbbb"}
    with httpx.Client(base_url=h.url, timeout=10) as http:
        made = http.post("/v1/responses", json={"input": "Hi"}, headers=a).json()
        assert http.get(f"/v1/responses/{made['id']}", headers=a).status_code == 200
        assert http.get(f"/v1/responses/{made['id']}", headers=b).status_code == 404
        r = http.post("/v1/responses", json={"input": "Hi", "previous_response_id": made["id"]}, headers=b)
        assert r.status_code == 404


def test_resume_endpoint_points_a_responses_request_to_its_own_api(gateway):
    h = gateway()
    with httpx.Client(base_url=h.url, timeout=10) as http:
        r = http.post("/v1/responses", json={"input": "Hi"})
        rid = r.headers["x-request-id"]
        assert r.json()["id"] == f"resp_{rid}"
        with http.stream("GET", f"/v1/requests/{rid}/events") as s:
            s.read()
            assert s.status_code == 400 and f"resp_{rid}" in s.json()["error"]["message"]


def test_an_idempotent_retry_returns_the_same_response(client):
    h, c = client
    key = {"Idempotency-Key": "resp-1"}
    first = c.responses.create(model=h.model.name, input="Hi", extra_headers=key)
    again = c.responses.create(model=h.model.name, input="Hi", extra_headers=key)
    assert again.id == first.id and again.output_text == first.output_text
    assert c.responses.retrieve(first.id).status == "completed"
    assert len(h.router.seen) == 1
