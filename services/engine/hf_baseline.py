"""The HF transformers twin of a loaded pdserve model, for baselines on the same device.

Built from our parameters rather than from a checkpoint, so that dummy:<preset>
models (random weights, no files) get a baseline with exactly their weights.
The HF model holds its own copy (HF keeps q/k/v and gate/up unfused).
"""

from __future__ import annotations

import torch

from services.engine.model import LlamaForCausalLM
from services.engine.model_config import ModelConfig


def hf_config(cfg: ModelConfig):
    """A transformers config that ``ModelConfig.from_hf`` reads back as ``cfg``."""
    from transformers import AutoConfig

    return AutoConfig.for_model(
        cfg.model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        rope_scaling=dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=cfg.qkv_bias,
        hidden_act="silu",
        eos_token_id=list(cfg.eos_token_ids) or None,
    )


def hf_twin(model: LlamaForCausalLM, device: str | torch.device | None = None):
    """An HF ``*ForCausalLM`` with ``model``'s config and weights, in its dtype, on ``device``
    (default: the model's). In eval mode."""
    from transformers import AutoModelForCausalLM

    weight = model.embed_tokens.weight
    device = torch.device(device) if device is not None else weight.device
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_config(model.config), dtype=weight.dtype)
    hf = hf.to(device)  # in case this transformers builds on the CPU despite the device context
    params = model.checkpoint_tensors()
    state = {}
    for key in hf.state_dict():
        # the checkpoint-name mapping the loader uses, run backwards
        name, rows = model._hf_target(key)
        if name == "lm_head.weight" and model.lm_head is None:
            name = "embed_tokens.weight"  # tied: the embedding is the output projection
        tensor = params[name]
        state[key] = tensor if rows is None else tensor[rows[0] : rows[1]]
    hf.load_state_dict(state, strict=True)
    return hf.eval()


class DeviceGenerate:
    """An HF model whose ``generate`` takes host tensors, as services.engine.bench builds its
    batches, and runs them on the model's device."""

    def __init__(self, hf_model):
        self.model = hf_model

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        device = self.model.device
        mask = attention_mask.to(device) if attention_mask is not None else None
        return self.model.generate(input_ids=input_ids.to(device), attention_mask=mask, **kwargs)
