"""The adapter store's formats (--lora-dtype, kernels/lora_quant.py) in the engine: bf16 stays PEFT's
merged model exactly, int8 and int4 stay within a stated logit tolerance of it (ranks 8, 16, 64,
through the torch reference in fp32 and the C kernels and fused decode driver in bf16), the
quantized stacks really hold int8 / packed int4, and bad settings are refused with a message."""

from __future__ import annotations

import pytest
import torch

from services.config import EngineConfig
from services.engine import lora_accuracy
from services.engine.engine import Engine
from services.engine.hf_baseline import hf_twin
from tests.engine.lora_adapters import make_adapter

# max |engine logit - PEFT merged fp32 logit| over 3 prompts x 8 greedy tokens, dummy:tiny, adapters of
# scale 0.1 that move the logits by 0.65-0.86: measured 0.007-0.020 (int8), 0.11-0.50 (int4)
TOLERANCE = {"int8": 0.05, "int4": 0.75}
RANKS = (8, 16, 64)


def _tiny(**config) -> Engine:
    config.setdefault("kv_cache_bytes", 4 << 20)
    return Engine(EngineConfig(model="dummy:tiny", max_lora_rank=64, **config))


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    shapes = _tiny(dtype="fp32").model
    root = tmp_path_factory.mktemp("loras")
    return {f"r{r}": make_adapter(shapes, root / f"r{r}", seed=r, r=r, alpha=2 * r, scale=0.1) for r in RANKS}


def _prompts() -> list[list[int]]:
    return [torch.randint(2, 512, (13 + i,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(3)]


def _against_peft(engine: Engine, adapters: dict) -> dict[str, dict]:
    out = {}
    for name, path in adapters.items():
        hf, base = lora_accuracy.peft_merged(engine.model, path), hf_twin(engine.model).float()
        out[name] = lora_accuracy.compare(engine, name, hf, base, _prompts(), 8)
        assert out[name]["adapter_shift_max_logit"] > 0.5, "the adapter must matter for the tolerance to mean anything"
    return out


@pytest.mark.parametrize("lora_dtype", ["bf16", "int8", "int4"])
def test_fp32_engine_against_peft(adapters, lora_dtype):
    engine = _tiny(dtype="fp32", lora_dtype=lora_dtype, loras={n: str(p) for n, p in adapters.items()})
    for name, got in _against_peft(engine, adapters).items():
        if lora_dtype == "bf16":  # the stacks in fp32: PEFT's merged model exactly, as before
            assert got["max_abs_logit_diff"] == 0 and got["all_equal"], name
        else:
            assert 0 < got["max_abs_logit_diff"] <= TOLERANCE[lora_dtype], (name, got)


@pytest.mark.parametrize("lora_dtype", ["int8", "int4"])
def test_bf16_engine_c_kernels_against_peft(adapters, lora_dtype):
    """bf16 activations: the C kernel reads the quantized stacks (the fused decode driver too); the
    distance to PEFT is the bf16 engine's own plus the quantization's."""
    loras = {n: str(p) for n, p in adapters.items()}
    engine = _tiny(dtype="bf16", lora_dtype=lora_dtype, loras=loras)
    assert engine.model.ops.name == "cpu" and engine.model._decode_layers(engine.kv_cache) is not None
    exact = _against_peft(_tiny(dtype="bf16", loras=loras), adapters)
    for name, got in _against_peft(engine, adapters).items():
        assert got["max_abs_logit_diff"] <= exact[name]["max_abs_logit_diff"] + TOLERANCE[lora_dtype], (name, got)
        assert got["max_abs_logit_diff"] != exact[name]["max_abs_logit_diff"], "the quantized stacks were not read"


@pytest.mark.parametrize("lora_dtype", ["int8", "int4"])
def test_fused_decode_driver_reads_quantized_stacks_as_the_python_layers_do(adapters, lora_dtype, monkeypatch):
    loras = {n: str(p) for n, p in adapters.items()}
    fused, python = (_tiny(dtype="bf16", lora_dtype=lora_dtype, loras=loras) for _ in range(2))
    monkeypatch.setattr(python.model, "_decode_layers", lambda kv_cache: None)
    prompt = _prompts()[0]
    for name in adapters:
        a, la = lora_accuracy.engine_greedy(fused, prompt, name, 6)
        b, lb = lora_accuracy.engine_greedy(python, prompt, name, 6)
        assert a == b and torch.equal(la, lb), name


@pytest.mark.parametrize("lora_dtype, a_dtype, bytes_per_weight", [("bf16", torch.bfloat16, 2),
                                                                   ("int8", torch.int8, 1), ("int4", torch.uint8, 0.5)])
def test_stacks_hold_the_format(adapters, lora_dtype, a_dtype, bytes_per_weight):
    engine = _tiny(dtype="bf16", lora_dtype=lora_dtype, loras={"r8": str(adapters["r8"])})
    assert engine.loras.acquire("r8") == 0
    a, bt = engine.loras.a["gate_up"], engine.loras.bt["gate_up"]  # [L, S, 2R, K], [L, S, R, 2 * inter]
    assert a.dtype == bt.dtype == a_dtype
    assert a.numel() * a.element_size() == a.shape[0] * a.shape[1] * a.shape[2] * 64 * bytes_per_weight
    assert bool(engine.loras.a_scale) == (lora_dtype != "bf16")


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="lora_dtype must be bf16, int8 or int4"):
        EngineConfig(model="dummy:tiny", lora_dtype="fp8")
    with pytest.raises(ValueError, match="--lora-dtype int4 has no GPU kernels"):
        EngineConfig(model="dummy:tiny", device="cuda", lora_dtype="int4")


def test_flag_reaches_the_workers():
    """``--lora-dtype`` on ``pdserve up`` is passed to every worker (which builds its EngineConfig
    from it); the default adds nothing; an unknown one is a usage error."""
    import argparse

    from services.generate import add_lora_args, lora_from_args
    from services.up import _lora_args

    parser = argparse.ArgumentParser()
    add_lora_args(parser)
    args = parser.parse_args(["--lora-dtype", "int8"])
    assert lora_from_args(args)["lora_dtype"] == "int8"
    assert _lora_args(args)[-2:] == ["--lora-dtype", "int8"]
    assert "--lora-dtype" not in _lora_args(parser.parse_args([]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--lora-dtype", "fp8"])
