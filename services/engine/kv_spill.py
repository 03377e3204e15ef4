"""The spill tier's bytes: evicted KV blocks in host memory or a memory-mapped file.

``spill_tier.SpillTier`` keeps the bookkeeping (hash -> slot, LRU); this holds the slots and
copies between them and the KV cache. A slot has the layout of one cache block
(``[num_layers, 2, block_size, num_kv_heads, row]``), so a copy is one gather per call.

What a slot holds (``--kv-spill-dtype``):

- ``int8`` (the default on CPU): each (token, KV head) row quantized as the int8 KV cache's
  rows are (``kernels/kv_int8.py``: ``head_dim`` int8 and an fp32 scale), 68 bytes instead of
  128 for a bf16 row of 64: 1.88x the blocks per byte. Lossy: a restored block's values differ
  from the computed ones by the row's rounding (measured in BENCHMARKS.md). A cache that is
  already int8 is copied as it is (lossless).
- ``auto``: the cache's own dtype, bit for bit (lossless; bf16 on a bf16 cache).

Where (``--kv-spill-dir``): host memory by default; with a directory, a file there mapped
shared (``torch.from_file``), unlinked at once so nothing is left behind when the process
ends: the kernel may write its pages out and drop them under memory pressure, so the tier can
be larger than the RAM one would give it (cheaper per byte, slower when a page must be read
back from disk).

Copies: a spill (``write``) runs on the engine thread while the pool hands the blocks out
(it must finish before anything overwrites them); a restore runs on this store's own thread
and the engine keeps stepping other requests meanwhile (torch's copy kernels release the GIL).

GPU (tests/engine/test_spill_tier_cuda.py, run on an H200): slots in pinned host memory, in the
cache's dtype; a spill is a device-to-host copy on a side stream that first waits for the
compute stream (the block's last write); the engine thread waits for the copy's bytes before it
scatters them into the slots, so no later forward can overwrite a block unsaved; a restore is a host-to-device copy on the side stream whose
completion an event reports (``done()``), so a restore never blocks the compute stream's kernels.
"""

from __future__ import annotations

import concurrent.futures
import os
import tempfile
from typing import Sequence

import torch

from kernels.kv_int8 import dequantize_rows
from services.engine.kv_cache import KVCacheSpec, _INT8_SCALE_BYTES

SPILL_DTYPES = ("int8", "auto")


def slot_bytes(spec: KVCacheSpec, spill_dtype: str) -> int:
    """Bytes of one slot: an int8 slot adds the scale to each row; ``auto`` is a cache block."""
    if spill_dtype == "auto" or spec.dtype == "int8":
        return spec.block_bytes
    return spec.num_layers * 2 * spec.block_size * spec.num_kv_heads * (spec.head_dim + _INT8_SCALE_BYTES)


class _CudaDone:
    """A restore on the GPU: done when its event has completed."""

    def __init__(self, event):
        self._event = event

    def done(self) -> bool:
        return self._event.query()

    def result(self, timeout: float | None = None) -> None:
        self._event.synchronize()


class SpillStore:
    def __init__(self, spec: KVCacheSpec, kv_cache: torch.Tensor, capacity_bytes: int, spill_dtype: str = "int8",
                 directory: str | None = None):
        if spill_dtype not in SPILL_DTYPES:
            raise ValueError(f"kv spill dtype must be one of {SPILL_DTYPES}; got {spill_dtype!r}")
        self.kv = kv_cache
        self.on_cuda = kv_cache.is_cuda
        # int8 slots only where quantizing helps: a float cache on the CPU (the GPU path keeps its dtype)
        self.quantized = spill_dtype == "int8" and spec.dtype != "int8" and not self.on_cuda
        self.slot_bytes = slot_bytes(spec, "int8" if self.quantized else "auto")
        self.num_slots = capacity_bytes // self.slot_bytes
        if self.num_slots < 1:
            raise ValueError(f"a spill tier of {capacity_bytes} bytes holds no block (one takes {self.slot_bytes})")
        row = spec.head_dim + _INT8_SCALE_BYTES if self.quantized else spec.row_elems
        dtype = torch.int8 if self.quantized else kv_cache.dtype
        shape = (self.num_slots, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, row)
        self.path = None
        if directory is not None:
            self.slots = _mapped(directory, shape, dtype)
            self.path = directory
        else:
            self.slots = torch.empty(shape, dtype=dtype, pin_memory=self.on_cuda)
        self.dtype_name = "int8" if self.quantized else str(dtype).removeprefix("torch.")
        if self.on_cuda:
            self._stream = torch.cuda.Stream(device=kv_cache.device)
        else:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pdserve-kv-restore")

    @property
    def where(self) -> str:
        return f"file in {self.path}" if self.path else ("pinned host memory" if self.on_cuda else "host memory")

    def write(self, blocks: Sequence[int], slots: Sequence[int]) -> None:
        """Copy cache blocks into slots; returns once nothing may overwrite the blocks' KV unsaved."""
        src = torch.tensor(list(blocks), dtype=torch.int64, device=self.kv.device)
        dst = torch.tensor(list(slots), dtype=torch.int64)
        if self.on_cuda:  # tests/engine/test_spill_tier_cuda.py
            compute = torch.cuda.current_stream(self.kv.device)
            self._stream.wait_stream(compute)
            with torch.cuda.stream(self._stream):
                staged = self.kv.index_select(0, src).to("cpu", non_blocking=True)
            # a non-blocking copy to the host returns before its bytes land: wait for them before
            # the host-side scatter reads them (and before any forward may overwrite the blocks)
            self._stream.synchronize()
            self.slots[dst] = staged
            return
        with torch.inference_mode():
            if not self.quantized:
                self.slots[dst] = self.kv.index_select(0, src)
                return
            # one block at a time: its fp32 temporaries stay in cache (5x faster than the whole
            # batch at once, ~2 ms for a 368 KB block on one loaded core); the bytes are
            # quantize_rows' (tests/engine/test_spill_tier.py)
            for block, slot in zip(blocks, slots):
                _quantize_into(self.kv[block], self.slots[slot])

    def restore(self, slots: Sequence[int], blocks: Sequence[int]):
        """Start copying slots into cache blocks; a handle with ``done()`` and ``result()``."""
        src = torch.tensor(list(slots), dtype=torch.int64)
        dst = torch.tensor(list(blocks), dtype=torch.int64, device=self.kv.device)
        if self.on_cuda:
            with torch.cuda.stream(self._stream):
                self.kv[dst] = self.slots.index_select(0, src).to(self.kv.device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            return _CudaDone(event)
        return self._pool.submit(self._copy_back, src, dst)

    def _copy_back(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        with torch.inference_mode():
            if not self.quantized:
                self.kv[dst] = self.slots.index_select(0, src)
                return
            for slot, block in zip(src.tolist(), dst.tolist()):  # one block at a time, as write
                self.kv[block] = dequantize_rows(self.slots[slot], self.kv.dtype)


def _quantize_into(block: torch.Tensor, out: torch.Tensor) -> None:
    """``quantize_rows(block)`` written into ``out`` without the batch-sized temporaries."""
    d = block.shape[-1]
    x = block.float()
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    x.div_(scale).round_()
    out[..., :d] = x
    out[..., d:] = scale.view(torch.int8)


def _mapped(directory: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled tensor backed by a new file in ``directory``, mapped shared, already unlinked."""
    if not os.path.isdir(directory):
        raise ValueError(f"--kv-spill-dir {directory!r} is not a directory")
    numel = 1
    for d in shape:
        numel *= d
    fd, path = tempfile.mkstemp(prefix="pdserve-kv-spill-", suffix=".bin", dir=directory)
    try:
        os.ftruncate(fd, numel * dtype.itemsize)  # sparse: disk is used as slots are written
        tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype)
    finally:
        os.close(fd)
        os.unlink(path)  # the mapping keeps the pages; no file outlives the process
    return tensor.view(shape)
