"""The small endpoints: models, tokenize, health, metrics; and waiting in the queue (heartbeats, deadline)."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.openai_format import server_version
from services.queue.cancel import cancel_key
from tests.gateway.harness import MODEL_LEN, wait_for
from tests.gateway.sse_client import chat_text, events


def _samples(http: httpx.Client) -> dict[tuple, float]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def test_models_and_tokenize(gateway):
    h = gateway()
    tok = h.model.tokenizer
    with httpx.Client(base_url=h.url, timeout=10) as http:
        models = http.get("/v1/models").json()
        assert models["object"] == "list"
        assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == \
            [(h.model.name, "model", MODEL_LEN)]
        r = http.post("/tokenize", json={"prompt": "Hello world"}).json()
        assert r == {"tokens": tok.encode("Hello world"), "count": len(tok.encode("Hello world")),
                     "max_model_len": MODEL_LEN}
        messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
        r = http.post("/tokenize", json={"messages": messages}).json()
        assert r["tokens"] == tok.apply_chat_template([{"role": "user", "content": "Hi"}])
        assert r["count"] == len(r["tokens"])


def test_model_by_id(gateway):
    """openai's models.retrieve: the served model's Model object, a 404 OpenAI error for another."""
    import openai

    h = gateway()
    with openai.OpenAI(base_url=f"{h.url}/v1", api_key="unused", max_retries=0) as client:
        model = client.models.retrieve(h.model.name)
        assert (model.id, model.object, model.owned_by) == (h.model.name, "model", "pdserve")
        with pytest.raises(openai.NotFoundError) as err:
            client.models.retrieve("gpt-4o")
        assert err.value.body["type"] == "model_not_found"


def test_health(gateway):
    h = gateway()
    with httpx.Client(base_url=h.url, timeout=10) as http:
        assert http.get("/health/live").status_code == 200
        ready = http.get("/health/ready")
        assert ready.status_code == 200 and ready.json()["decode_workers"] == 1
        # vLLM's probes: /health and /ping (GET and POST) answer 200 with an empty body
        for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
            r = http.request(method, path)
            assert (r.status_code, r.content) == (200, b""), (method, path)
        assert http.get("/version").json() == {"version": server_version()}


def test_health_is_503_without_a_ready_decode_worker(gateway):
    h = gateway(decode_worker=False)
    with httpx.Client(base_url=h.url, timeout=10) as http:
        for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
            r = http.request(method, path)
            assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
            assert "no ready decode worker" in r.json()["error"]["message"]


def test_metrics_count_outcomes_ttft_and_queue_depth(gateway):
    h = gateway()
    ok = ("pdserve_gateway_requests_total", (("api", "chat"), ("outcome", "ok")))
    invalid = ("pdserve_gateway_requests_total", (("api", "chat"), ("outcome", "invalid")))
    ttft = ("pdserve_ttft_seconds_count", (("role", "gateway"),))
    with httpx.Client(base_url=h.url, timeout=10) as http:
        before = _samples(http)
        chat = {"messages": [{"role": "user", "content": "Hi"}]}
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
            events(r)
        assert http.post("/v1/chat/completions", json={**chat, "n": 99}).status_code == 400
        after = _samples(http)
    assert after[ok] - before.get(ok, 0) == 2
    assert after[invalid] - before.get(invalid, 0) == 1
    assert after[ttft] - before.get(ttft, 0) == 2
    assert ("pdserve_queue_depth", (("tier", "standard"),)) in after


def test_a_queued_request_gets_heartbeats_then_its_tokens(gateway):
    h = gateway(sse_heartbeat_s=0.2)
    h.router.pause()
    chat = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
    with httpx.Client(base_url=h.url, timeout=10) as http:
        with http.stream("POST", "/v1/chat/completions", json=chat) as r:
            lines = r.iter_lines()
            seen = []
            for line in lines:  # the opening, then comments while nothing is dequeued
                seen.append(line)
                if seen.count(": keep-alive") == 2:
                    break
            h.router.paused = False
            rest = events(lines)
    assert chat_text(rest) == "Hello, world!" and rest[-1].done


def test_heartbeats_between_events_do_not_break_the_openai_client(gateway):
    """openai's SSE decoder keeps the last event id, so a comment followed by a blank line after any
    event read as an event with empty data and raised JSONDecodeError mid-stream (seen in a burst
    where requests waited more than the heartbeat interval). A heartbeat is a comment line alone."""
    h = gateway(sse_heartbeat_s=0.1)
    h.router.pause()
    threading.Timer(1.0, lambda: setattr(h.router, "paused", False)).start()  # ~10 heartbeats first
    with openai.OpenAI(base_url=f"{h.url}/v1", api_key="unused", max_retries=0, timeout=20) as client:
        stream = client.chat.completions.create(model=h.model.name, messages=[{"role": "user", "content": "Hi"}],
                                                stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "Hello, world!"


def test_a_request_past_its_deadline_gets_a_deadline_error_and_is_cancelled(gateway, sync_redis):
    h = gateway(deadline_grace_s=0.1, sse_heartbeat_s=0.1)
    h.router.pause()  # no router: nobody writes the deadline error, the gateway gives up itself
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    with httpx.Client(base_url=h.url, timeout=10) as http:
        r = http.post("/v1/chat/completions", json=chat, headers={"x-pdserve-timeout": "0.3"})
        assert r.status_code == 504 and r.json()["error"]["type"] == "deadline_exceeded"
        rid = r.headers["x-request-id"]
        with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True},
                         headers={"x-pdserve-timeout": "0.3"}) as s:
            evs = events(s)
        assert evs[-2].json["error"]["type"] == "deadline_exceeded" and evs[-1].done
    assert wait_for(lambda: sync_redis.exists(cancel_key(rid)))  # nobody waits for it any more


def test_profiling_endpoint_is_off_by_default(gateway):
    h = gateway()
    reply = httpx.post(f"{h.url}/admin/profile", params={"seconds": 1}, timeout=10)
    assert reply.status_code == 404
