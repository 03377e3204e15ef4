"""The contract check itself: it accepts what pdserve sends, and catches the defects it exists for."""

from __future__ import annotations

import httpx

from services.gateway.openai_format import ResponseAggregate, StreamFormatter
from services.gateway.request_record import CHAT, COMPLETION, RequestRecord
from tests.openai_spec.validator import errors_of

CHAT_RESPONSE = "#/components/schemas/CreateChatCompletionResponse"
CHAT_CHUNK = "#/components/schemas/CreateChatCompletionStreamResponse"
FINAL = {"finish_reason": "stop", "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
CHUNK = {"token_ids": [7], "text": "Hi", "logprobs": [{"token_id": 7, "token": "Hi", "logprob": -0.5, "top": []}]}


def _chat_body(logprobs: int | None = None) -> dict:
    aggregate = ResponseAggregate(RequestRecord("r1", CHAT, "m", 1, "t", logprobs=logprobs))
    aggregate.add(CHUNK)
    return aggregate.body(FINAL)


def test_pdserve_bodies_conform_and_the_old_defects_would_not():
    assert errors_of(_chat_body(), CHAT_RESPONSE) == []
    assert errors_of(_chat_body(logprobs=0), CHAT_RESPONSE) == []
    no_refusal = _chat_body()
    del no_refusal["choices"][0]["message"]["refusal"]
    assert errors_of(no_refusal, CHAT_RESPONSE)  # the message's refusal is required
    null_fingerprint = {**_chat_body(), "system_fingerprint": None}
    assert errors_of(null_fingerprint, CHAT_RESPONSE)  # typed as a string
    stream = StreamFormatter(RequestRecord("r2", CHAT, "m", 1, "t"), include_usage=True)
    for chunk in stream.opening() + stream.chunk(CHUNK) + stream.final(FINAL):
        assert errors_of(chunk, CHAT_CHUNK) == [], chunk


def test_completion_chunks_may_have_null_finish_reason_but_not_a_wrong_one():
    stream = StreamFormatter(RequestRecord("r3", COMPLETION, "m", 1, "t"), include_usage=True)
    ref = "#/components/schemas/PdserveCompletionStreamChunk"
    for chunk in stream.chunk(CHUNK) + stream.final(FINAL):
        assert errors_of(chunk, ref) == [], chunk
    [chunk] = stream.chunk(CHUNK)
    chunk["choices"][0]["finish_reason"] = "abort"
    assert errors_of(chunk, ref)


def test_the_hook_sees_the_gateways_answers(gateway, openai_contract):
    h = gateway()
    with httpx.Client(base_url=h.url, timeout=10) as http:
        http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
        with http.stream("POST", "/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": "Hi"}], "stream": True}) as r:
            r.read()
        http.post("/v1/chat/completions", json={"messages": []})  # a 400: ErrorResponse
    assert openai_contract.checked >= 1 + 7 + 1
    assert openai_contract.violations == []
    # a body that breaks the schema is reported
    openai_contract.check({"object": "list"}, "#/components/schemas/ListModelsResponse", "by hand")
    assert openai_contract.violations and "data" in openai_contract.violations[0]
    openai_contract.violations.clear()
