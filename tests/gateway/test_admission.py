"""Who may queue what, and when not: API keys, shared rate limits, backpressure, readiness, tiers, deadlines."""

from __future__ import annotations

import time

import httpx
from redis.exceptions import ConnectionError as RedisConnectionError

from services.queue import QueuedRequest
from services.queue.cancel import cancel_key
from services.queue.keys import tier_stream
from tests.gateway.harness import register_decode_worker, wait_for

ACME = "sk-acme-0000000001"
BATCHY = "sk-batchy-00000002"
SLOW = "sk-slow-000000003"
KEYS = {ACME: {"tenant": "acme", "tier": "interactive", "rpm": 3, "tpm": 100_000},
        BATCHY: {"tenant": "batchy", "tier": "batch", "tpm": 100},
        SLOW: {"tenant": "slow", "rpm": 1}}
BODY = {"prompt": [1, 2, 3], "max_tokens": 4}


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_api_keys_are_required_when_configured(gateway):
    h = gateway(keys=KEYS)
    with httpx.Client(base_url=h.url, timeout=10) as http:
        for headers in ({}, auth("sk-wrong-key-000"), {"Authorization": ACME}):
            r = http.post("/v1/completions", json=BODY, headers=headers)
            assert r.status_code == 401, headers
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/v1/models").status_code == 401
        r = http.post("/v1/completions", json=BODY, headers=auth(ACME))
        assert r.status_code == 200
    [queued] = h.router.seen
    assert (queued.tenant, queued.tier) == ("acme", "interactive")


def test_rate_limit_is_shared_by_gateway_replicas(gateway):
    one, two = gateway(keys=KEYS), gateway(keys=KEYS)
    with httpx.Client(timeout=10) as http:
        remaining = []
        for h in (one, two, one):
            r = http.post(f"{h.url}/v1/completions", json=BODY, headers=auth(ACME))
            assert r.status_code == 200
            assert r.headers["x-ratelimit-limit-requests"] == "3"
            remaining.append(r.headers["x-ratelimit-remaining-requests"])
        assert remaining == ["2", "1", "0"]
        r = http.post(f"{two.url}/v1/completions", json=BODY, headers=auth(ACME))
        assert r.status_code == 429
        assert r.json()["error"]["type"] == "rate_limit_exceeded"
        assert int(r.headers["Retry-After"]) >= 1
        assert r.headers["x-ratelimit-limit-requests"] == "3"
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert r.headers["x-ratelimit-reset-requests"].endswith("s")
        assert r.headers["x-ratelimit-limit-tokens"] == "100000"
        assert int(r.headers["x-ratelimit-remaining-tokens"]) > 0
    assert len(one.router.seen) + len(two.router.seen) == 3  # the refused one was never queued


def test_token_budget_counts_prompt_and_max_tokens(gateway):
    h = gateway(keys=KEYS)
    with httpx.Client(base_url=h.url, timeout=10) as http:
        body = {"prompt": [1, 2, 3], "max_tokens": 40}  # 43 tokens each of 100 a minute
        statuses = [http.post("/v1/completions", json=body, headers=auth(BATCHY)) for _ in range(3)]
        assert [r.status_code for r in statuses] == [200, 200, 429]
        assert statuses[1].headers["x-ratelimit-remaining-tokens"] == "14"
        assert "tokens" in statuses[2].json()["error"]["message"]
        huge = http.post("/v1/completions", json={"prompt": [1], "max_tokens": 500}, headers=auth(BATCHY))
        assert huge.status_code == 400 and huge.json()["error"]["param"] == "max_tokens"


def test_a_retry_with_its_idempotency_key_is_not_charged_again(gateway):
    h = gateway(keys=KEYS)
    with httpx.Client(base_url=h.url, timeout=10) as http:
        headers = {**auth(SLOW), "Idempotency-Key": "once"}
        first = http.post("/v1/completions", json=BODY, headers=headers)
        retry = http.post("/v1/completions", json=BODY, headers=headers)  # the budget of 1/min is spent
        assert (first.status_code, retry.status_code) == (200, 200)
        assert retry.headers["x-request-id"] == first.headers["x-request-id"]
        assert http.post("/v1/completions", json=BODY, headers=auth(SLOW)).status_code == 429
    assert len(h.router.seen) == 1


def test_priority_header_may_lower_the_tier_but_never_raise_it(gateway):
    h = gateway(keys=KEYS)
    with httpx.Client(base_url=h.url, timeout=10) as http:
        assert http.post("/v1/completions", json=BODY,
                         headers={**auth(ACME), "x-pdserve-priority": "batch"}).status_code == 200
        r = http.post("/v1/completions", json=BODY, headers={**auth(BATCHY), "x-pdserve-priority": "interactive"})
        assert r.status_code == 200 and r.headers["x-pdserve-priority"] == "batch"
        bad = http.post("/v1/completions", json=BODY, headers={**auth(ACME), "x-pdserve-priority": "urgent"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-pdserve-priority"
    assert h.router.tiers_seen == ["batch", "batch"]


def test_timeout_header_sets_the_deadline(gateway):
    h = gateway()
    with httpx.Client(base_url=h.url, timeout=10) as http:
        assert http.post("/v1/completions", json=BODY, headers={"x-pdserve-timeout": "5"}).status_code == 200
        assert http.post("/v1/completions", json=BODY).status_code == 200
        for bad in ("soon", "-1", "nan", "1e9"):
            r = http.post("/v1/completions", json=BODY, headers={"x-pdserve-timeout": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "x-pdserve-timeout"
    short, default = (q.deadline - q.enqueued_at for q in h.router.seen)
    assert 4 < short <= 5.1 and 599 < default <= 600.1


def _fill_queue(h, prompts: list[int]) -> None:
    async def fill():
        for n in prompts:
            rid = f"filler-{time.monotonic_ns()}"
            await h.core.queue.enqueue(QueuedRequest(rid, "t", "batch", h.model.name, [1] * n, {}))
    h.call(fill)


def test_backpressure_answers_429_before_queueing(gateway):
    h = gateway(max_queued_requests=2, max_queued_tokens=120, retry_after_s=3.0)
    h.router.pause()  # nothing leaves the queue
    with httpx.Client(base_url=h.url, timeout=10) as http:
        _fill_queue(h, [100])
        r = http.post("/v1/completions", json={"prompt": [1] * 30, "max_tokens": 2})  # 130 tokens > 120
        assert r.status_code == 429 and r.headers["Retry-After"] == "3"
        assert r.json()["error"]["type"] == "capacity_exceeded"
        _fill_queue(h, [1])
        r = http.post("/v1/completions", json=BODY)  # 2 requests queued: at the limit
        assert r.status_code == 429 and "requests" in r.json()["error"]["message"], r.text
    assert h.call(h.core.queue.depth).requests == 2  # neither refusal was queued


def test_overload_refusals_do_not_spend_the_rate_budget(gateway):
    h = gateway(keys=KEYS, max_queued_requests=1)
    h.router.pause()
    _fill_queue(h, [1])
    with httpx.Client(base_url=h.url, timeout=10) as http:
        for _ in range(2):
            r = http.post("/v1/completions", json=BODY, headers=auth(SLOW))
            assert r.status_code == 429 and r.json()["error"]["type"] == "capacity_exceeded"
        h.router.paused = False  # the filler is served and leaves the queue
        assert _wait_queue_empty(h)
        assert http.post("/v1/completions", json=BODY, headers=auth(SLOW)).status_code == 200


def _wait_queue_empty(h, timeout_s: float = 5.0) -> bool:
    give_up = time.monotonic() + timeout_s
    while h.call(h.core.queue.depth).requests and time.monotonic() < give_up:
        time.sleep(0.02)
    return h.call(h.core.queue.depth).requests == 0


def test_no_ready_decode_worker_is_503(gateway, sync_redis):
    h = gateway(decode_worker=False, retry_after_s=2.0)
    with httpx.Client(base_url=h.url, timeout=10) as http:
        r = http.post("/v1/completions", json=BODY)
        assert r.status_code == 503 and r.headers["Retry-After"] == "2"
        assert r.json()["error"]["type"] == "service_unavailable"
        assert http.get("/health/ready").status_code == 503
        register_decode_worker(sync_redis, ready=True, worker_id="decode-draining")
        sync_redis.set("pd:worker:decode-draining", sync_redis.get("pd:worker:decode-draining").replace(
            b'"draining": false', b'"draining": true'))
        assert http.post("/v1/completions", json=BODY).status_code == 503
        register_decode_worker(sync_redis, ready=True)
        assert http.get("/health/ready").json() == {"status": "ready", "decode_workers": 1}
        assert http.post("/v1/completions", json=BODY).status_code == 200
    assert len(h.router.seen) == 1


def _count_depth_reads(h) -> list[float]:
    """The times the gateway reads the queue depth from now on."""
    calls = []
    original = h.core.queue.depth

    async def counting():
        calls.append(time.monotonic())
        return await original()

    h.core.queue.depth = counting
    return calls


def test_depth_is_cached_between_reads(gateway):
    h = gateway(depth_cache_s=30.0)
    calls = _count_depth_reads(h)
    with httpx.Client(base_url=h.url, timeout=10) as http:
        for _ in range(3):
            assert http.post("/v1/completions", json=BODY).status_code == 200
    assert len(calls) == 1


def test_an_idle_gateway_does_not_read_the_queue_depth(gateway):
    h = gateway(depth_cache_s=0.01)
    calls = _count_depth_reads(h)

    async def start():  # what `pdserve gateway` starts: the background views
        h.core.start()

    h.call(start)
    time.sleep(0.3)  # thirty times depth_cache_s: the old background loop read every 8 ms
    assert calls == []
    with httpx.Client(base_url=h.url, timeout=10) as http:
        assert http.post("/v1/completions", json=BODY).status_code == 200
    assert len(calls) == 1  # the request that found no value read it


def test_readiness_follows_workers_joining_and_leaving_without_reading_the_registry(gateway, sync_redis,
                                                                                 monkeypatch):
    """The gateway's worker list follows what workers publish: a worker that registers is ready at once and
    one that deregisters is gone, with no whole-registry read in between (it read every 200 ms)."""
    from services.gateway import readiness
    from services.registry import Registrar, WorkerInfo

    monkeypatch.setattr(readiness, "REREAD_S", 60.0)  # only the first read: the rest must come by messages
    h = gateway(decode_worker=False, workers_cache_s=0.02)

    def reads() -> int:
        return int(sync_redis.info("commandstats").get("cmdstat_smembers", {}).get("calls", 0))

    async def start():
        h.core.start()

    h.call(start)
    info = WorkerInfo(worker_id="decode-joins", role="decode", address="127.0.0.1:1", model="SmolLM2-135M-Instruct",
                      namespace="test", block_size=16, max_model_len=2048, ready=True)
    registrar = Registrar(h.core.redis, info, interval_s=0.05, ttl_s=30)
    with httpx.Client(base_url=h.url, timeout=10) as http:
        assert wait_for(lambda: h.core.workers.following)  # its first read is done
        assert http.get("/health/ready").status_code == 503  # nobody registered
        before = reads()
        h.call(registrar.start)
        assert wait_for(lambda: http.get("/health/ready").json().get("decode_workers") == 1)
        h.call(registrar.stop)
        assert wait_for(lambda: http.get("/health/ready").status_code == 503)
        assert reads() == before


def test_a_request_whose_record_cannot_be_written_is_refused_and_cancelled(gateway, sync_redis):
    # the record (what a resume needs) and the queue entry are written side by side: when only the
    # entry lands, the client is told the queue is unavailable and the request is cancelled, not run
    # for a client that can never read it
    h = gateway()
    h.router.pause()

    async def refused(_record):
        raise RedisConnectionError("the record write was lost")

    h.core.records.save = refused
    with httpx.Client(base_url=h.url, timeout=10) as http:
        r = http.post("/v1/completions", json={**BODY, "stream": True})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    [(_, fields)] = sync_redis.xrange(tier_stream("standard"))
    request_id = fields[b"request_id"].decode()
    assert sync_redis.exists(cancel_key(request_id))
    h.router.paused = False
    assert wait_for(lambda: request_id in h.router.cancelled)
    assert not h.router.finished


def test_a_request_refused_at_enqueue_gets_its_rate_budget_back(gateway):
    # the backpressure check passed, the budget was taken, then the queue itself refused (its own
    # atomic limit, or Redis went away): the caller must not have paid for a request never queued
    from services.errors import CapacityError

    h = gateway(keys=KEYS)
    original = h.core.queue.admit
    failures = [CapacityError("the queue is full (1 queued requests, limit 1)"),
                RedisConnectionError("Redis went away")]

    async def refusing(_queued, **_claim):
        raise failures.pop(0)

    h.core.queue.admit = refusing
    with httpx.Client(base_url=h.url, timeout=10) as http:
        assert http.post("/v1/completions", json=BODY, headers=auth(SLOW)).status_code == 429
        assert http.post("/v1/completions", json=BODY, headers=auth(SLOW)).status_code == 503
        h.core.queue.admit = original
        r = http.post("/v1/completions", json=BODY, headers=auth(SLOW))  # SLOW has 1 request per minute
        assert r.status_code == 200, r.text
        assert http.post("/v1/completions", json=BODY, headers=auth(SLOW)).status_code == 429  # now spent


def test_api_keys_are_neither_kept_nor_logged(gateway, caplog):
    import logging

    h = gateway(keys=KEYS)
    assert not any(key in repr(vars(h.core.keys)) for key in KEYS)  # held as digests only
    caplog.set_level(logging.DEBUG)
    with httpx.Client(base_url=h.url, timeout=10) as http:
        assert http.post("/v1/completions", json=BODY, headers=auth(ACME)).status_code == 200
        assert http.post("/v1/completions", json=BODY, headers=auth("sk-wrong-00000000")).status_code == 401
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert ACME not in logged and "sk-wrong-00000000" not in logged
