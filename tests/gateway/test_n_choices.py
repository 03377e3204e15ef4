"""``n`` > 1 and ``best_of`` through the official ``openai`` client: one queue entry of n choices, one stream each."""

from __future__ import annotations

import httpx
import pytest

from services.gateway.choices import merge_bodies
from tests.gateway.fake_router import DEFAULT_PIECES, Plan
from tests.gateway.harness import wait_for
from tests.gateway.sse_client import events

EXPECTED = "".join(DEFAULT_PIECES)
MSG = [{"role": "user", "content": "Say hello"}]


def test_chat_n3_returns_three_indexed_choices_seeded_per_choice(client):
    h, c = client
    r = c.chat.completions.create(model=h.model.name, messages=MSG, n=3, seed=7, temperature=0.8, max_tokens=8)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert all(ch.message.content == EXPECTED and ch.finish_reason == "stop" for ch in r.choices)
    assert sorted(q.sampling["seed"] for q in h.router.seen) == [7, 8, 9]  # choice i: seed + i
    assert len({q.token_ids == h.router.seen[0].token_ids for q in h.router.seen}) == 1
    prompt = len(h.router.seen[0].token_ids)
    assert r.usage.prompt_tokens == prompt  # counted once
    assert r.usage.completion_tokens == 3 * len(DEFAULT_PIECES)
    assert r.usage.total_tokens == prompt + 3 * len(DEFAULT_PIECES)


def test_streamed_completion_n2_tags_chunks_with_their_choice_and_sums_usage(client):
    h, c = client
    chunks = list(c.completions.create(model=h.model.name, prompt="Once upon a time", n=2, stream=True,
                                       max_tokens=5, stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert texts == {0: EXPECTED, 1: EXPECTED}
    assert finish == {0: "stop", 1: "stop"}
    assert [ch.usage is not None for ch in chunks].count(True) == 1 and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 2 * len(DEFAULT_PIECES)
    assert chunks[-1].usage.prompt_tokens == len(h.router.seen[0].token_ids)
    assert len(h.router.seen) == 2


def test_streamed_chat_n2_opens_each_choice_with_the_role(client):
    h, c = client
    chunks = list(c.chat.completions.create(model=h.model.name, messages=MSG, n=2, stream=True, max_tokens=8))
    roles = sorted(ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].delta.role)
    assert roles == [0, 1]
    text = {i: "".join(ch.choices[0].delta.content or "" for ch in chunks
                       if ch.choices and ch.choices[0].index == i) for i in (0, 1)}
    assert text == {0: EXPECTED, 1: EXPECTED}


def test_best_of_runs_every_candidate_and_returns_n_without_unasked_logprobs(client):
    h, c = client
    r = c.completions.create(model=h.model.name, prompt="Hi", best_of=3, max_tokens=5)
    assert len(r.choices) == 1 and r.choices[0].index == 0 and r.choices[0].logprobs is None
    assert len(h.router.seen) == 3
    assert all(q.sampling["logprobs"] == 0 for q in h.router.seen)  # asked for, to rank by
    assert r.usage.completion_tokens == 3 * len(DEFAULT_PIECES)  # every candidate's tokens, as OpenAI bills


def _body(text: str, logprobs: list[float]) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": {"token_logprobs": logprobs}}
    return {"id": "cmpl-x", "choices": [choice],
            "usage": {"prompt_tokens": 4, "completion_tokens": len(logprobs), "total_tokens": 4 + len(logprobs)}}


def test_best_of_keeps_the_n_highest_cumulative_logprobs():
    bodies = [_body("a", [-1.0, -1.0]), _body("b", [-0.1]), _body("c", [-0.5, -0.2])]
    merged = merge_bodies(bodies, 2, ranked=True, keep_logprobs=False)
    assert [(ch["index"], ch["text"]) for ch in merged["choices"]] == [(0, "b"), (1, "c")]
    assert all(ch["logprobs"] is None for ch in merged["choices"])
    assert merged["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_every_choice(gateway, stream):
    h = gateway(disconnect_grace_s=0.2)
    h.router.plan = lambda req: Plan(pieces=("x",) * 200, delay_s=0.02)
    body = {"messages": MSG, "n": 3, "seed": 1, "temperature": 1.0, "stream": stream}
    with httpx.Client(base_url=h.url, timeout=10) as http:
        if stream:
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                events(r, limit=4)
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/chat/completions", json=body, timeout=0.5)
    assert wait_for(lambda: len(h.router.seen) == 3
                    and sorted(h.router.cancelled) == sorted(q.request_id for q in h.router.seen))
    assert h.router.finished == []


@pytest.mark.parametrize("stream", [True, False])
def test_one_failing_choice_ends_the_response_with_its_error_and_cancels_the_others(gateway, stream):
    h = gateway(disconnect_grace_s=0.2)
    h.router.plan = lambda req: (Plan(pieces=("x",) * 3, error_after=1) if req.sampling["seed"] == 2
                                 else Plan(pieces=("x",) * 200, delay_s=0.02))
    body = {"messages": MSG, "n": 3, "seed": 1, "temperature": 1.0, "stream": stream}
    with httpx.Client(base_url=h.url, timeout=10) as http:
        if stream:
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                got = events(r)
            assert got[-1].done and "error" in got[-2].json
            assert got[-2].json["error"]["code"] == "kv_transfer_error"
        else:
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 502 and r.json()["error"]["code"] == "kv_transfer_error"
    others = sorted(q.request_id for q in h.router.seen if q.sampling["seed"] != 2)
    assert wait_for(lambda: sorted(h.router.cancelled) == others)


def test_the_cap_is_the_gateways_max_n(gateway):
    h = gateway(max_n=2)
    with httpx.Client(base_url=h.url, timeout=10) as http:
        over = http.post("/v1/chat/completions", json={"messages": MSG, "n": 3})
        assert over.status_code == 400 and over.json()["error"]["param"] == "n"
        assert "--max-n" in over.json()["error"]["message"]
        assert http.post("/v1/completions", json={"prompt": "Hi", "best_of": 3}).json()["error"]["param"] == "best_of"
        assert len(http.post("/v1/chat/completions", json={"messages": MSG, "n": 2}).json()["choices"]) == 2
    assert len(h.router.seen) == 2  # the refused requests queued nothing


def test_n3_is_one_queue_entry_charged_for_every_choice(gateway):
    """One request against the tenant's request budget; every choice's prompt and max_tokens against its tokens,
    as when each choice was a request of its own."""
    h = gateway(keys={"sk-tpm-000000000001": {"tenant": "tpm", "rpm": 10, "tpm": 1000}})
    with httpx.Client(base_url=h.url, timeout=10) as http:
        headers = {"Authorization": "Bearer sk-tpm-000000000001"}
        r = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 7, "n": 3}, headers=headers)
        assert r.status_code == 200 and len(r.json()["choices"]) == 3
        assert r.headers["x-ratelimit-remaining-tokens"] == str(1000 - 3 * (3 + 7))
        assert r.headers["x-ratelimit-remaining-requests"] == "9"
    [entry] = h.router.entries
    assert entry.choices == 3 and len(h.router.seen) == 3


def test_a_retry_with_its_idempotency_key_attaches_to_every_choice(gateway):
    h = gateway()
    with httpx.Client(base_url=h.url, timeout=10) as http:
        body = {"prompt": "Hi", "n": 2, "seed": 4, "temperature": 1.0, "max_tokens": 5}
        first = http.post("/v1/completions", json=body, headers={"Idempotency-Key": "n2-once"})
        again = http.post("/v1/completions", json=body, headers={"Idempotency-Key": "n2-once"})
    assert first.status_code == again.status_code == 200
    assert [c["text"] for c in again.json()["choices"]] == [c["text"] for c in first.json()["choices"]] == [EXPECTED] * 2
    assert first.headers["x-request-id"] == again.headers["x-request-id"]
    assert len(h.router.entries) == 1 and len(h.router.seen) == 2  # nothing queued again
