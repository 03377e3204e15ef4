"""RoPE frequency tables: the config's theta plus its scaling (linear, llama3, dynamic NTK at load).

Produces the fp32 ``cos_sin_cache`` ``[max_positions, head_dim]`` that
kernels.rotary consumes.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    # fp32, in HF's order of operations, so fp32 logits match HF exactly.
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = s["factor"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


def build_cos_sin_cache(
    head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None = None
) -> torch.Tensor:
    inv_freq = _inv_freq(head_dim, theta)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    elif kind == "dynamic":
        # Static NTK scaling to the configured maximum: exact for prompts within
        # the original context only when factor == 1, which is what HF does there.
        factor = scaling["factor"]
        orig = scaling.get("original_max_position_embeddings", max_positions)
        if max_positions > orig:
            base = theta * ((factor * max_positions / orig) - (factor - 1)) ** (head_dim / (head_dim - 2))
            inv_freq = _inv_freq(head_dim, base)
    elif kind != "default":
        raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3, dynamic")
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()
