"""Shared engines for the engine tests.

- ``tiny_engine(**config)``: a fresh engine on ``dummy:tiny`` (random weights, fp32,
  loads in milliseconds), with a small KV cache unless told otherwise. Engines
  built with the same ``seed`` have the same weights, so one can serve as the
  reference for another.
- ``default_engine``: one session-wide engine on the real default model
  (SmolLM2-135M-Instruct, fp32, small KV cache; ~7 s to load). Tests get it
  through ``default_model``, which checks that it is idle before and after.
- ``default_tokenizer``: the default model's tokenizer, without loading weights.

Every engine is leak-checked after every test by tests/conftest.py (no requests,
no used blocks); a test that fails mid-way has its leftovers aborted so later
tests start clean.
"""

from __future__ import annotations

import pytest
import torch

from services.config import EngineConfig
from services.engine.engine import Engine
from services.engine.kv_cache import KVCacheSpec
from services.engine.model_config import preset_config

_tiny = preset_config("tiny")
# bytes of one KV block of dummy:tiny in fp32 at block size 16: pass multiples as kv_cache_bytes
TINY_BLOCK_BYTES = KVCacheSpec(_tiny.num_layers, _tiny.num_kv_heads, _tiny.head_dim, 16, "float32").block_bytes
DEFAULT_KV_BYTES = 64 << 20


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread; on a shared CPU, idle OpenMP workers spinning
    for a second core make them many times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def tiny_engine(one_thread):
    def make(num_blocks: int = 256, **config) -> Engine:
        """``num_blocks`` counts the null block too (usable = num_blocks - 1)."""
        config.setdefault("kv_cache_bytes", num_blocks * TINY_BLOCK_BYTES)
        return Engine(EngineConfig(model="dummy:tiny", dtype="fp32", **config))

    return make


@pytest.fixture(scope="session")
def default_engine() -> Engine:
    return Engine(EngineConfig(dtype="fp32", kv_cache_bytes=DEFAULT_KV_BYTES))


@pytest.fixture
def default_model(default_engine: Engine) -> Engine:
    """The session engine, idle (every test before this one ended with the leak check)."""
    return default_engine


@pytest.fixture(scope="session")
def default_tokenizer():
    """The default model's tokenizer alone (no weights loaded)."""
    from services.engine.model_source import model_card
    from services.engine.tokenizer import Tokenizer

    return Tokenizer(model_card(None).tokenizer_dir)
