"""Byte views of whole KV blocks, and coalescing of adjacent block ids into runs.

Because block ``b`` of the cache is the contiguous byte range
``[b * block_bytes, (b + 1) * block_bytes)`` (the cache's layout: ``descriptor.LAYOUT``),
a run of adjacent block ids is one contiguous range, moved as one message::

    src ids  7  8  9 | 12 13 | 14        coalesce(src=[7,8,9,12,13,14],
    dst ids  3  4  5 |  9 10 | 20                 dst=[3,4,5,9,10,20])
             run 0     run 1   run 2     -> [(7, 3, 3), (12, 9, 2), (14, 20, 1)]

A run breaks wherever either side stops being adjacent. The views below
alias the cache tensor: nothing is copied in Python, transports read and
write the cache memory directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class Run(NamedTuple):
    src: int  # first source block id
    dst: int  # first destination block id
    count: int


def coalesce(src: Sequence[int], dst: Sequence[int]) -> list[Run]:
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks for {len(dst)} destination blocks")
    runs: list[Run] = []
    for s, d in zip(src, dst):
        if runs:
            last = runs[-1]
            if s == last.src + last.count and d == last.dst + last.count:
                runs[-1] = Run(last.src, last.dst, last.count + 1)
                continue
        runs.append(Run(s, d, 1))
    return runs


class BlockBytes:
    """The KV cache seen as ``num_blocks`` rows of ``block_bytes`` bytes."""

    def __init__(self, kv: torch.Tensor):
        if not kv.is_contiguous():
            raise ValueError("KV tensor must be contiguous: blocks are moved as byte ranges")
        self.num_blocks = kv.shape[0]
        self.block_bytes = kv[0].numel() * kv.element_size()
        self.device = kv.device
        # uint8 alias of the whole cache; slicing it is a view, never a copy.
        self._bytes = kv.view(-1).view(torch.uint8)

    def run(self, first_block: int, count: int) -> torch.Tensor:
        """Contiguous uint8 view of blocks ``[first_block, first_block + count)``."""
        if first_block < 1 or count < 1 or first_block + count > self.num_blocks:
            raise ValueError(f"blocks [{first_block}, {first_block + count}) outside 1..{self.num_blocks - 1}")
        start = first_block * self.block_bytes
        return self._bytes[start : start + count * self.block_bytes]

    def check_ids(self, block_ids: Sequence[int], what: str) -> None:
        bad = [b for b in block_ids if not 1 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"{what} block ids {bad[:8]} outside 1..{self.num_blocks - 1}")
