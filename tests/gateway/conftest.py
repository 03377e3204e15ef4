"""Fixtures: ``gateway(**config)`` starts the real gateway app on a real Redis with a fake router (harness.py).

A decode worker entry is registered in the real registry unless
``decode_worker=False``. The database is emptied once per test, before the
first gateway starts, so two gateways in one test share Redis like replicas.
"""

from __future__ import annotations

import pytest
import redis

from services.gateway.api_keys import ApiKeys
from services.gateway.config import GatewayConfig
from tests.gateway.harness import MODEL_LEN, GatewayHarness, register_decode_worker


@pytest.fixture(scope="session")
def served_model():
    from services.gateway.served_model import load_served_model

    return load_served_model(None)


@pytest.fixture
def sync_redis(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    yield r
    r.close()


@pytest.fixture
def gateway(redis_url, served_model, sync_redis):
    """``gateway(decode_worker=True, keys=None, grpc=False, model_len=None, **GatewayConfig fields)``."""
    started: list[GatewayHarness] = []

    def start(decode_worker: bool = True, keys: dict | None = None, grpc: bool = False,
              model_len: int = MODEL_LEN, **config) -> GatewayHarness:
        if decode_worker and not started:
            register_decode_worker(sync_redis, model_len)
        settings = {"depth_cache_s": 0.0, "workers_cache_s": 0.0, "disconnect_grace_s": 0.0, **config}
        cfg = GatewayConfig(**settings)
        api_keys = ApiKeys.from_mapping(keys, cfg.tiers, cfg.default_tier) if keys else None
        harness = GatewayHarness(redis_url, served_model, cfg, api_keys, grpc)
        started.append(harness)
        return harness.start()

    yield start
    for h in started:
        h.stop()


@pytest.fixture
def client(gateway):
    """``(harness, openai.OpenAI)``: the official client against a default gateway."""
    import openai

    h = gateway()
    c = openai.OpenAI(base_url=f"{h.url}/v1", api_key="unused", max_retries=0, timeout=20)
    yield h, c
    c.close()
