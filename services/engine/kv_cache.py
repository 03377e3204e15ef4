"""The paged KV-cache tensor: its layout, its size, and its allocation.

Layout (one tensor for the whole model)::

    kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
         |          |          |
         |          |          +-- 0 = K, 1 = V
         |          +------------- every layer of one block is contiguous
         +------------------------ block id, as handed out by BlockPool

Why this order: a block's data for all layers is one contiguous run of
``block_bytes``, and adjacent block ids are adjacent runs, so moving the KV of a
prompt to another process (kvtransfer) is a handful of large copies instead of
``num_layers * 2`` small ones per block. Attention reads one layer at a time
through ``layer_view`` (a strided view, no copy); gathering a block's 6 KiB of
K for one layer costs the same in either order.

Block 0 is the null block: never allocated, used to pad block tables.

An int8 cache (``--kv-cache-dtype int8``, kernels/kv_int8.py) has rows of ``head_dim + 4``
int8: the quantized values, then their fp32 scale's bytes, so a block is still one run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}
_INT8_SCALE_BYTES = 4  # the fp32 scale at the end of each int8 row (kernels/kv_int8.py)


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")


@dataclass(frozen=True)
class KVCacheSpec:
    """Everything a peer must agree on to read or write our KV blocks."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # "float32" | "bfloat16" | "float16" | "int8" (rows of head_dim int8 + an fp32 scale)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        dtype_from_name(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def row_elems(self) -> int:
        """Elements of one (token, KV head) row: head_dim, + the scale's 4 bytes for int8."""
        return self.head_dim + (_INT8_SCALE_BYTES if self.dtype == "int8" else 0)

    @property
    def block_numel(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.row_elems

    @property
    def block_bytes(self) -> int:
        return self.block_numel * self.torch_dtype.itemsize

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.row_elems)

    def num_blocks_for_budget(self, budget_bytes: int) -> int:
        return max(0, budget_bytes // self.block_bytes)


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device | str = "cpu") -> torch.Tensor:
    if num_blocks < 2:
        raise ValueError(
            f"KV cache needs at least 2 blocks (one is the null block), got {num_blocks}; "
            "raise the KV memory budget"
        )
    return torch.zeros(spec.shape(num_blocks), dtype=spec.torch_dtype, device=device)


def layer_view(kv: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer as ``[num_blocks, block_size, num_kv_heads, head_dim]`` views."""
    return kv[:, layer, 0], kv[:, layer, 1]
