"""The official ``openai`` client against the gateway: streaming and not, chat and completions."""

from __future__ import annotations

import pytest

from services.gateway.openai_format import server_version
from tests.gateway.fake_router import DEFAULT_PIECES, Plan

EXPECTED = "".join(DEFAULT_PIECES)
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_streamed_chat_completion_has_the_scripted_text_and_usage(client):
    h, c = client
    stream = c.chat.completions.create(model=h.model.name, messages=[{"role": "user", "content": "Say hello"}],
                                       stream=True, stream_options={"include_usage": True}, max_tokens=8,
                                       temperature=0, seed=7, stop=["\n\n"], top_p=0.9, user="alice",
                                       extra_headers={"traceparent": TRACEPARENT})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {ch.system_fingerprint for ch in chunks} == {f"pdserve-{server_version()}"}
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == EXPECTED
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(ch.usage is None for ch in chunks[:-1])
    usage = chunks[-1].usage
    [queued] = h.router.seen
    assert usage.prompt_tokens == len(queued.token_ids) and usage.completion_tokens == len(DEFAULT_PIECES)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 3
    assert {ch.id for ch in chunks} == {f"chatcmpl-{queued.request_id}"}
    # what the router got: the templated prompt and the sampling parameters as SamplingParams names
    assert queued.token_ids == h.model.tokenizer.apply_chat_template([{"role": "user", "content": "Say hello"}])
    assert queued.sampling == {"max_tokens": 8, "temperature": 0, "seed": 7, "stop": ["\n\n"], "top_p": 0.9}
    assert queued.tier == "standard" and queued.tenant == "default"
    assert queued.traceparent.split("-")[1] == TRACEPARENT.split("-")[1]  # the client's trace continues


def test_streamed_completion_has_the_scripted_text(client):
    h, c = client
    stream = c.completions.create(model=h.model.name, prompt="Once upon a time", stream=True, max_tokens=5,
                                  stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(ch.object == "text_completion" for ch in chunks)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == EXPECTED
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(DEFAULT_PIECES)
    [queued] = h.router.seen
    assert queued.token_ids == h.model.tokenizer.encode("Once upon a time")
    assert queued.sampling["max_tokens"] == 5


def test_streamed_completion_without_include_usage_has_no_usage_chunk(client):
    h, c = client
    chunks = list(c.completions.create(model=h.model.name, prompt="Hi", stream=True))
    assert all(ch.choices for ch in chunks) and all(ch.usage is None for ch in chunks)
    assert h.router.seen[0].sampling["max_tokens"] == 16  # OpenAI's completions default


def test_non_streamed_chat_and_completion(client):
    h, c = client
    chat = c.chat.completions.create(model=h.model.name, max_completion_tokens=12,
                                     messages=[{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.content == EXPECTED and chat.choices[0].message.role == "assistant"
    # OpenAI's schema requires the message's refusal (null here) and types system_fingerprint as a string
    assert "refusal" in chat.choices[0].message.model_fields_set and chat.choices[0].message.refusal is None
    assert chat.system_fingerprint == f"pdserve-{server_version()}"
    assert chat.choices[0].finish_reason == "stop"
    assert chat.usage.completion_tokens == len(DEFAULT_PIECES) and chat.usage.prompt_tokens > 0
    assert h.router.seen[0].sampling["max_tokens"] == 12
    assert h.router.seen[0].sampling.get("logprobs") is None

    done = c.completions.create(model=h.model.name, prompt=[1, 2, 3], max_tokens=4)
    assert done.choices[0].text == EXPECTED and done.usage.prompt_tokens == 3
    assert h.router.seen[1].token_ids == [1, 2, 3]


def test_chat_logprobs(client):
    h, c = client
    chat = c.chat.completions.create(model=h.model.name, messages=[{"role": "user", "content": "Hi"}],
                                     logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert [t.token for t in content] == list(DEFAULT_PIECES)
    assert content[1].logprob == pytest.approx(-0.5) and len(content[1].top_logprobs) == 2
    assert content[0].bytes == list(b"Hello")
    assert h.router.seen[0].sampling["logprobs"] == 2

    stream = list(c.completions.create(model=h.model.name, prompt="Hi", logprobs=1, stream=True))
    tokens = [t for ch in stream if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert tokens == list(DEFAULT_PIECES)
    offsets = [o for ch in stream if ch.choices and ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset]
    assert offsets == [0, 5, 6, 10, 12]


def test_finish_reason_length_passes_through(client):
    h, c = client
    h.router.plan = lambda req: Plan(finish_reason="length")
    chat = c.chat.completions.create(model=h.model.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
    assert chat.choices[0].finish_reason == "length"
