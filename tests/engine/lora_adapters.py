"""Small random PEFT LoRA adapters for a pdserve model's shapes, written with ``peft`` itself
(``save_pretrained``: adapter_config.json + adapter_model.safetensors), PEFT's merged HF model, and
a batch of requests with adapters run through an engine."""

from __future__ import annotations

from pathlib import Path

import dataclasses

import torch

from services.engine.hf_baseline import hf_config
from services.engine.lora_accuracy import peft_merged  # noqa: F401 (the tests' import of it)

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _randomize(peft_model, seed: int, scale: float) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:  # both A and B non-zero (PEFT initializes B to zero)
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def make_adapter(model, directory: Path, seed: int, r: int = 8, alpha: int = 16, modules=None,
                 scale: float = 0.05, rslora: bool = False) -> Path:
    """An adapter for ``model``'s shapes (a pdserve LlamaForCausalLM) saved under ``directory``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_config(hf_config(model.config), dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=modules or ALL,
                                                 use_rslora=rslora, lora_dropout=0.0))
    _randomize(peft_model, seed, scale)
    peft_model.save_pretrained(str(directory))
    return directory


def run_batch(engine, prompts: dict, params) -> dict[str, list[int]]:
    """``prompts``: request id -> (token ids, adapter or None), all added at once (one batch) with
    ``params``, stepped to the end: request id -> generated tokens."""
    for rid, (ids, lora) in prompts.items():
        engine.add_request(rid, ids, dataclasses.replace(params, lora=lora))
    got = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    return got
