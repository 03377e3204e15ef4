"""The HF twin that ``pdserve bench gpu`` races against is the same model: its config
reads back as ours, and it generates our greedy tokens from our weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.ops import TORCH_OPS
from services.config import EngineConfig
from services.engine.engine import Engine
from services.engine.hf_baseline import DeviceGenerate, hf_config, hf_twin
from services.engine.loader import load_model
from services.engine.model_source import ModelSource
from services.engine.model_config import ModelConfig, preset_config
from services.engine.sampling_params import SamplingParams
from tests.engine.checks import assert_no_leaks, generate, tokens


@pytest.mark.parametrize("preset", ["llama-3.2-1b", "llama-3.1-8b", "smollm2-135m", "qwen2-0.5b", "tiny"])
def test_hf_config_reads_back_as_ours(preset):
    ours = preset_config(preset)
    back = ModelConfig.from_hf(hf_config(ours).to_dict())
    for f in dataclasses.fields(ModelConfig):
        if f.name in ("extra", "rope_scaling"):
            continue
        assert getattr(back, f.name) == getattr(ours, f.name), f.name
    # transformers may copy rope_theta into the scaling dict; the scaling itself must survive
    scaling = {k: v for k, v in (back.rope_scaling or {}).items() if k != "rope_theta"} or None
    assert scaling == ours.rope_scaling


def test_hf_twin_generates_our_greedy_tokens():
    engine = Engine(EngineConfig(model="dummy:tiny", dtype="fp32", kv_cache_bytes=16 << 20))
    prompt = [(37 * i) % 500 + 3 for i in range(21)]
    ours = tokens(generate(engine, {"p": prompt}, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))["p"])
    hf = DeviceGenerate(hf_twin(engine.model))
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert out[0, len(prompt):].tolist() == ours
    assert_no_leaks(engine)


def test_hf_twin_of_tied_embeddings_projects_with_the_embedding():
    cfg = dataclasses.replace(preset_config("tiny"), tie_word_embeddings=True)
    ours = load_model(ModelSource("tied", cfg, None, None), TORCH_OPS, torch.float32, "cpu", max_positions=64)
    hf = hf_twin(ours)
    emb = ours.embed_tokens.weight
    assert torch.equal(hf.get_output_embeddings().weight, emb) and torch.equal(hf.get_input_embeddings().weight, emb)
    q, k, v = ours.layers[1].self_attn.qkv_proj.weight.split([64, 32, 32])
    attn = hf.model.layers[1].self_attn
    for hf_weight, ours_rows in ((attn.q_proj.weight, q), (attn.k_proj.weight, k), (attn.v_proj.weight, v)):
        assert torch.equal(hf_weight, ours_rows)
