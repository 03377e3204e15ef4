"""Multi-LoRA through the disaggregated stack as ``pdserve up`` starts it (LocalStack): the
official openai client selects adapters by ``model``, /v1/models lists them with their parent,
an unknown adapter is a 400 before anything is queued, the router's gRPC API selects one by
``model``, and adapters are added and removed at run time through the admin endpoint. Every
greedy output equals the engine's own with the same adapter (the prefill worker computes the
prompt under it, the decode worker continues under it)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
import redis

from proto.pdserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from services.engine.lora_bench import write_random_adapter
from services.launcher import LocalStack, StackSpec

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    from services.engine.model_source import resolve_model

    cfg = resolve_model(None).config
    root = tmp_path_factory.mktemp("loras")
    return {name: write_random_adapter(cfg, root / name, rank, seed, b_std=0.1)
            for name, rank, seed in (("terse", 8, 1), ("chatty", 16, 2), ("late", 8, 3))}


@pytest.fixture(scope="module")
def reference(adapters):
    """The engine alone (fp32, as the stack runs): greedy tokens of QUESTION per adapter."""
    from services.config import EngineConfig
    from services.engine.engine import Engine
    from services.engine.sampling_params import SamplingParams

    engine = Engine(EngineConfig(dtype="fp32", kv_cache_bytes=64 << 20,
                                 loras={n: str(p) for n, p in adapters.items()}))
    prompt = engine.tokenizer.apply_chat_template(QUESTION)
    out = {}
    for name in (None, *adapters):
        engine.add_request(str(name), prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, lora=name))
        toks = []
        while engine.has_unfinished():
            for o in engine.step():
                toks += o.new_token_ids
        out[name] = engine.tokenizer.decode(toks)
    assert len(set(out.values())) == len(out), out  # each adapter changes the answer
    return out


@pytest.fixture(scope="module")
def stack(redis_url, adapters):
    redis.Redis.from_url(redis_url).flushdb()
    spec = StackSpec(prefill=1, decode=1, dtype="fp32", threads=1, kv_cache_gb=0.25, redis_url=redis_url,
                     worker_args=[f"--lora=terse={adapters['terse']}", f"--lora=chatty={adapters['chatty']}",
                                  "--max-loras", "2"],
                     gateway_args=["--enable-lora-admin"])
    with LocalStack(spec) as s:
        s.redis_url = redis_url
        yield s


@pytest.fixture(scope="module")
def client(stack):
    from openai import OpenAI

    return OpenAI(base_url=f"http://{stack.gateway_address}/v1", api_key="none", max_retries=0)


def _chat(client, model: str) -> str:
    reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert reply.model == model
    return reply.choices[0].message.content


def test_models_lists_the_adapters_with_their_parent(client):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {MODEL, "terse", "chatty"}
    assert models["terse"].parent == MODEL and models["chatty"].parent == MODEL
    assert client.models.retrieve("terse").parent == MODEL


def test_each_adapter_and_the_base_in_one_batch_match_the_engine(client, reference):
    with ThreadPoolExecutor(4) as pool:
        got = dict(zip((None, "terse", "chatty", f"{MODEL}:terse"),
                       pool.map(lambda m: _chat(client, m or MODEL), (None, "terse", "chatty", f"{MODEL}:terse"))))
    assert got[None] == reference[None]
    assert got["terse"] == reference["terse"] == got[f"{MODEL}:terse"]
    assert got["chatty"] == reference["chatty"]


def test_unknown_adapter_is_a_400_and_an_unknown_model_a_404(client):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, f"{MODEL}:nope")
    assert err.value.body["param"] == "model" and "unknown LoRA adapter 'nope'" in err.value.body["message"]
    assert "chatty" in err.value.body["message"]  # it names the ones served
    with pytest.raises(openai.NotFoundError):
        _chat(client, "nope")


def _grpc(stack, model: str) -> tuple[list[int], object]:
    async def run():
        async with grpc.aio.insecure_channel(stack.router_address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            req = generate_pb2.GenerateRequest(model=model, sampling=common_pb2.SamplingParams(
                max_tokens=12, temperature=0, ignore_eos=True))
            req.chat.messages.extend(generate_pb2.ChatMessage(**m) for m in QUESTION)
            ids, finish = [], None
            async for msg in stub.Generate(req, timeout=120):
                if msg.HasField("chunk"):
                    ids += msg.chunk.token_ids
                else:
                    finish = msg.finish
            listed = await stub.ListModels(generate_pb2.ListModelsRequest())
            return ids, finish, listed
    return asyncio.run(run())


def test_grpc_selects_an_adapter_by_model(stack, reference):
    from services.engine.model_source import model_card
    from services.engine.tokenizer import Tokenizer

    ids, finish, listed = _grpc(stack, "chatty")
    assert Tokenizer(model_card(None).tokenizer_dir).decode(ids) == reference["chatty"]
    assert finish.finish_reason == "length"
    assert {m.id: m.parent for m in listed.models} == {MODEL: "", "terse": MODEL, "chatty": MODEL}
    with pytest.raises(grpc.RpcError) as err:
        _grpc(stack, f"{MODEL}:nope")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_admin_endpoint_adds_and_removes_an_adapter_at_run_time(client, stack, adapters, reference, tmp_path):
    base = f"http://{stack.gateway_address}"
    r = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(adapters["late"])})
    assert r.status_code == 200, r.text
    assert "late" in {m.id for m in client.models.list().data}
    # two slots per worker, three adapters now: one is read from disk again on demand
    assert _chat(client, "late") == reference["late"]
    assert _chat(client, "terse") == reference["terse"]
    bad = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": str(tmp_path)})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    assert httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    assert "late" not in {m.id for m in client.models.list().data}
    assert httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 404
