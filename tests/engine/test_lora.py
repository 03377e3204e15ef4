"""Multi-LoRA in the engine: greedy outputs with an adapter equal PEFT's merged model in HF
transformers; a batch mixing four adapters and none gives each request the tokens it gets alone;
the prefix cache never serves a block across adapters; adapters load on demand into an LRU of
slots; unknown or unservable adapters are refused with the parameter named."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from services.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams
from services.errors import InvalidRequestError
from tests.engine.lora_adapters import make_adapter, peft_merged, run_batch

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _tiny(**config) -> Engine:
    config.setdefault("kv_cache_bytes", 4 << 20)
    config.setdefault("dtype", "fp32")
    return Engine(EngineConfig(model="dummy:tiny", **config))


def _run(engine: Engine, prompts: dict) -> dict[str, list[int]]:
    return run_batch(engine, prompts, GREEDY)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Four adapters for dummy:tiny's shapes: every projection at rank 8 and 16, attention only,
    MLP only with rsLoRA scaling."""
    shapes = _tiny().model
    root = tmp_path_factory.mktemp("loras")
    specs = {"all8": dict(r=8), "all16": dict(r=16, alpha=8), "qv": dict(r=8, modules=["q_proj", "v_proj"]),
             "mlp": dict(r=16, modules=["gate_proj", "up_proj", "down_proj"], rslora=True)}
    return {name: make_adapter(shapes, root / name, seed=i + 1, scale=0.3, **kw)
            for i, (name, kw) in enumerate(specs.items())}


def test_greedy_with_adapter_equals_peft_merged_model(adapters):
    engine = _tiny(loras={n: str(p) for n, p in adapters.items()})
    prompt = _prompt(0, 21)
    base = _run(engine, {"base": (prompt, None)})["base"]
    for name, path in adapters.items():
        got = _run(engine, {name: (prompt, name)})[name]
        hf = peft_merged(engine.model, path)
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):]
        assert got == want.tolist(), name
        assert got != base, f"{name} changed nothing: the test would not see a missing adapter"


def test_mixed_batch_of_four_adapters_matches_each_alone(adapters):
    """bf16: the C kernels (kernels/lora_cpu.c) run the batch; fewer than 32 rows a step, so the
    base projections take the same kernel batched and alone."""
    loras = {n: str(p) for n, p in adapters.items()}
    batched = _tiny(dtype="bf16", loras=loras)
    assert batched.model.ops.name == "cpu"
    prompts = {name: (_prompt(i, 5), name) for i, name in enumerate(adapters)}
    prompts["base"] = (_prompt(9, 5), None)
    together = _run(batched, prompts)
    alone = _tiny(dtype="bf16", loras=loras, enable_prefix_caching=False)
    for rid, prompt in prompts.items():
        assert _run(alone, {rid: prompt})[rid] == together[rid], rid
    # the adapters matter: the same prompt gives different tokens under each
    same = _prompt(3, 5)
    outs = _run(batched, {f"s-{n}": (same, n) for n in [*adapters, None]})
    assert len({tuple(v) for v in outs.values()}) == len(outs)


def test_prefix_cache_is_namespaced_by_adapter(adapters):
    engine = _tiny(loras={n: str(p) for n, p in adapters.items()})
    reference = _tiny(loras={n: str(p) for n, p in adapters.items()}, enable_prefix_caching=False)
    prompt = _prompt(5, 40)  # two full blocks of 16

    def cached(rid: str, lora: str | None) -> tuple[int, list[int]]:
        engine.add_request(rid, prompt, dataclasses.replace(GREEDY, lora=lora))
        toks, hit = [], None
        while engine.has_unfinished():
            for out in engine.step():
                toks += out.new_token_ids
                hit = out.num_cached_tokens
        return hit, toks

    assert cached("a1", "all8")[0] == 0
    hit, toks = cached("base", None)
    assert hit == 0 and toks == _run(reference, {"r": (prompt, None)})["r"]
    hit, toks = cached("b1", "qv")
    assert hit == 0 and toks == _run(reference, {"r": (prompt, "qv")})["r"]
    hit, toks = cached("a2", "all8")
    # its two full blocks hit, and the rest's KV but the last token is copied from a1's next block
    assert hit == len(prompt) - 1 and toks == _run(reference, {"r": (prompt, "all8")})["r"]


def test_adapters_load_on_demand_into_an_lru_of_slots(adapters):
    engine = _tiny(loras={n: str(p) for n, p in adapters.items()}, max_loras=2)
    alone = _tiny(loras={n: str(p) for n, p in adapters.items()}, max_loras=4)
    names = list(adapters)[:3]
    prompts = {n: (_prompt(i, 7), n) for i, n in enumerate(names)}
    # three adapters, two slots: the third request waits for a slot, then runs
    got = _run(engine, prompts)
    for rid, prompt in prompts.items():
        assert got[rid] == _run(alone, {rid: prompt})[rid]
    assert engine.loras.loads == 3 and len(engine.loaded_loras()) == 2
    evicted = next(n for n in names if n not in engine.loaded_loras())
    _run(engine, {"again": (prompts[evicted][0], evicted)})
    assert engine.loras.loads == 4 and evicted in engine.loaded_loras()


def test_unknown_adapter_is_refused_before_anything_is_held(adapters):
    engine = _tiny(loras={"all8": str(adapters["all8"])})
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'nope'") as err:
        engine.add_request("x", _prompt(0, 5), dataclasses.replace(GREEDY, lora="nope"))
    assert err.value.param == "model"
    assert not engine.requests and engine.block_pool.num_used == 0 and not engine.has_unfinished()


@pytest.mark.parametrize("edit, message", [
    ({"r": 32}, "above --max-lora-rank 16"),
    ({"use_dora": True}, "DoRA is not supported"),
    ({"bias": "all"}, "trained biases"),
    ({"target_modules": ["embed_tokens"]}, "not LoRA-able here"),
    ({"peft_type": "IA3"}, "is not LORA"),
])
def test_unservable_adapters_are_refused_naming_the_setting(adapters, tmp_path, edit, message):
    for f in adapters["all8"].iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(InvalidRequestError, match=message):
        _tiny().register_lora("bad", str(tmp_path))


def test_an_adapter_for_other_shapes_is_refused_when_loaded(adapters, tmp_path):
    other = Engine(EngineConfig(model="dummy:tiny", dtype="fp32", kv_cache_bytes=4 << 20))
    other_model = other.model
    other_model.config = dataclasses.replace(other_model.config, hidden_size=128)
    engine = _tiny()
    with pytest.raises(InvalidRequestError, match="needs"):
        engine.register_lora("wide", str(make_adapter(other_model, tmp_path / "wide", seed=3)))
        engine.add_request("w", _prompt(0, 5), dataclasses.replace(GREEDY, lora="wide"))
    assert not engine.requests and engine.block_pool.num_used == 0


def test_fused_decode_driver_runs_adapters_as_the_python_layers_do(adapters, monkeypatch):
    """bf16 decode steps with adapters go through the C decode driver (kernels/decode_layers_cpu.c),
    which makes the LoRA kernel calls of the Python layer loop: the same logits, bit for bit."""
    loras = {n: str(p) for n, p in adapters.items()}
    fused = _tiny(dtype="bf16", loras=loras)
    assert fused.model._decode_layers(fused.kv_cache) is not None
    python = _tiny(dtype="bf16", loras=loras)
    monkeypatch.setattr(python.model, "_decode_layers", lambda kv_cache: None)
    calls = []
    driver = fused.model._decode_layers(fused.kv_cache)
    monkeypatch.setattr(type(driver), "_point_at_lora",
                        lambda self, batch, real=type(driver)._point_at_lora: calls.append(1) or real(self, batch))
    prompts = {name: (_prompt(i, 6), name) for i, name in enumerate(adapters)}
    prompts["base"] = (_prompt(8, 6), None)
    logits = {}
    for engine in (fused, python):
        seen = []
        compute = engine.model.compute_logits
        monkeypatch.setattr(engine.model, "compute_logits", lambda h, c=compute, s=seen: s.append(c(h)) or s[-1])
        tokens = _run(engine, prompts)
        logits[engine is fused] = (tokens, seen)
    assert calls, "the driver never ran a LoRA step"
    assert logits[True][0] == logits[False][0]
    assert all(torch.equal(a, b) for a, b in zip(logits[True][1], logits[False][1]))
