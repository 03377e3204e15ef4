"""Rotary position embedding (GPT-NeoX / HF "rotate_half" style): torch reference.

``cos_sin_cache[pos] = cat(cos(pos * inv_freq), sin(pos * inv_freq))``, shape
``[max_positions, head_dim]`` in fp32 (services.engine.rope builds it, with the
config's theta and scaling). Returns new q, k; inputs are not modified.
"""

from __future__ import annotations

import torch


def rotary_ref(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # int64 [T]
    cos_sin_cache: torch.Tensor,  # fp32 [max_pos, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    half = q.shape[-1] // 2
    cos_sin = cos_sin_cache[positions]
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
