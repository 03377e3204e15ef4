"""Per-forward attention state: where this step's tokens live in the paged KV cache.

Built once per step by the runner and passed down every layer (never a module
global). Tokens are ordered decodes first, then prefill chunks::

    tokens:  [ d0 d1 ... d(D-1) | p0 p0 p0 ... | p1 p1 ... ]
              one per decode seq   chunk of seq0   chunk of seq1
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    kv_cache: torch.Tensor  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor  # int64 [T]: block_id * block_size + offset, per token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # int32 [D, M]
    decode_context_lens: torch.Tensor | None  # int32 [D]
    prefill_block_tables: torch.Tensor | None  # int32 [P, M]
    prefill_cu_seqlens_q: torch.Tensor | None  # int32 [P + 1], offsets into the prefill tokens
    prefill_context_lens: torch.Tensor | None  # int32 [P]
    lora: Any = None  # services.engine.lora_slots.LoRABatch when a row has an adapter

    @property
    def has_prefill(self) -> bool:
        return self.prefill_block_tables is not None
