"""CUDA graphs for decode-only steps: static inputs, one captured graph per (batch, width) bucket.

Why: a decode step of a 1B model is ~200 kernels of a few microseconds each.
Launched one by one from Python they take longer than the GPU needs to run
them; a captured graph launches them all at once.

What a graph freezes is every tensor address and shape and every host-side
choice made while it was captured (the decode kernel's split count). So:

- Inputs live in one static buffer, written before each replay. They are
  packed so that a step is one host-to-device copy from pinned memory::

      [ ids | positions | slots | context_lens | sample_rows | lora_rows | block_table ]
        B     B           B       B              B             B           b * w
      (B = the largest captured batch; the (b, w) graph reads the first b of
       each region and sees the block table as a contiguous [b, w])

- A batch of n decodes runs in the graph of the next captured size b >= n.
  Rows n..b-1 are padding: token 0 at position 0, slot -1 (write_kv skips
  negative slots), context length 1 over block 0 (the null block, which is
  never allocated, so reading it is harmless), adapter slot -1 (the base
  model). Their outputs are dropped.

- An engine started with LoRA adapters (``--lora``) captures a second set of
  graphs whose forward runs the gathered LoRA kernels (kernels/lora.py) over
  ``lora_rows``, each row's adapter slot (-1: none), and over the adapter
  stacks, allocated before the capture so that their addresses stay what the
  graphs read (loading an adapter writes into its slot). A batch with an
  adapter replays those; a batch without replays the plain set, which
  launches no LoRA kernels. An engine started without adapters captures only
  the plain set: adapters registered later run their steps eagerly.
  Padding is cheap: a decode step reads every weight once whatever the batch.

- The block table has a captured width w (columns), the next power of two
  at or above the longest context's block count. One maximal width would do
  for correctness, but the decode kernel splits every context into
  ``num_splits(b, w)`` chunks (split-K): under a 131072-token width a
  512-token context at batch 1 gets a single active chunk, 8 programs for a
  132-SM GPU. And the table copied per step is b * w entries. Power-of-two
  buckets keep every context at least half of its width.

Only the Triton ops are graph-safe: the torch reference ``write_kv_ref`` would
write a slot of -1 into the last block (negative indexing), and the reference
decode attention gathers the whole table width every step. Steps with prefill
chunks, batches above the largest captured size and the torch backend run
eagerly in ``ModelRunner``.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.engine.attention_metadata import AttentionMetadata
from services.engine.lora_slots import LoRABatch, LoRASlots
from services.engine.model import LlamaForCausalLM
from services.engine.request import Request
from services.engine.scheduler import ScheduledRequest

# No graphs above this batch: capture time and memory grow with it, and by
# then a step is long enough that launch overhead no longer matters.
MAX_CAPTURE_BATCH = 512
# Narrowest block-table width, in tokens: contexts this short split into at
# most two chunks anyway, so narrower graphs would change nothing.
MIN_WIDTH_TOKENS = 256


def batch_ladder(max_batch: int) -> list[int]:
    """Captured batch sizes: 1 2 4 8, every 8 to 64, every 16 to 128, every 32 beyond; always ``max_batch``.

    Denser at the bottom, where padding one row to the next size is relatively
    the most work."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, 129, 16), *range(160, max_batch + 1, 32)]
    sizes = [s for s in sizes if s < max_batch]
    return sizes + [max_batch]


def width_ladder(max_blocks: int, min_blocks: int) -> list[int]:
    """Captured block-table widths: powers of two from ``min_blocks``, then ``max_blocks``."""
    if max_blocks < 1 or min_blocks < 1:
        raise ValueError(f"widths must be >= 1, got max {max_blocks}, min {min_blocks}")
    widths = []
    w = 1 << (min_blocks - 1).bit_length()
    while w < max_blocks:
        widths.append(w)
        w *= 2
    return widths + [max_blocks]


def bucket(value: int, ladder: list[int]) -> int | None:
    """The smallest rung >= ``value``; None above the top."""
    for rung in ladder:
        if rung >= value:
            return rung
    return None


@dataclass(frozen=True)
class StaticDecodeInputs:
    """The views one (batch, width) graph reads, all into the same packed buffer."""

    input_ids: torch.Tensor  # [b]
    positions: torch.Tensor  # [b]
    slot_mapping: torch.Tensor  # [b]
    context_lens: torch.Tensor  # [b]
    sample_rows: torch.Tensor  # [b], read after the replay (which rows' logits are computed)
    lora_rows: torch.Tensor  # [b], each row's adapter slot (-1: the base model)
    block_table: torch.Tensor  # [b, w], contiguous


@dataclass(frozen=True)
class DecodeInputLayout:
    """Where each input of a padded decode batch lives in the packed buffer (see module doc)."""

    max_batch: int
    max_width: int

    @property
    def size(self) -> int:
        return 6 * self.max_batch + self.max_batch * self.max_width

    def used(self, batch: int, width: int) -> int:
        """Leading entries a (batch, width) step reads: what must be copied to the device."""
        return 6 * self.max_batch + batch * width

    def views(self, buf: torch.Tensor, batch: int, width: int) -> StaticDecodeInputs:
        B = self.max_batch
        return StaticDecodeInputs(
            input_ids=buf[0:batch],
            positions=buf[B : B + batch],
            slot_mapping=buf[2 * B : 2 * B + batch],
            context_lens=buf[3 * B : 3 * B + batch],
            sample_rows=buf[4 * B : 4 * B + batch],
            lora_rows=buf[5 * B : 5 * B + batch],
            block_table=buf[6 * B : 6 * B + batch * width].view(batch, width),
        )

    def pack(self, out, batch: int, width: int, tokens: list[int], positions: list[int], slots: list[int],
             block_rows: list[list[int]], sample_rows: list[int], lora_rows: list[int] | None = None) -> int:
        """Write ``len(tokens)`` real rows padded up to ``batch`` into ``out`` (a 1-D numpy array
        or CPU tensor of ``size`` entries). Context length is position + 1; ``lora_rows`` None:
        no adapters. Returns ``used()``."""
        n, B = len(tokens), self.max_batch
        if not 0 < n <= batch <= B or not width <= self.max_width:
            raise ValueError(f"cannot pack {n} rows into batch {batch}, width {width} (max {B}, {self.max_width})")
        pad = batch - n
        out[0:batch] = tokens + [0] * pad
        out[B : B + batch] = positions + [0] * pad
        out[2 * B : 2 * B + batch] = slots + [-1] * pad
        out[3 * B : 3 * B + batch] = [p + 1 for p in positions] + [1] * pad
        out[4 * B : 4 * B + len(sample_rows)] = sample_rows
        out[5 * B : 5 * B + batch] = (lora_rows or [-1] * n) + [-1] * pad
        table: list[int] = []
        for row in block_rows:
            if len(row) > width:
                raise ValueError(f"a row needs {len(row)} blocks, more than width {width}")
            table += row
            table += [0] * (width - len(row))
        table += [0] * (pad * width)
        out[6 * B : 6 * B + batch * width] = table
        return self.used(batch, width)


class CudaGraphRunner:
    """Replays captured graphs for decode-only batches; ``execute`` answers None for anything else."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int, max_batch: int,
                 max_model_len: int, lora_slots: LoRASlots | None = None):
        self.model = model
        self.lora_slots = lora_slots  # None: no LoRA graphs (a batch with an adapter runs eagerly)
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        self.batch_sizes = batch_ladder(min(max_batch, MAX_CAPTURE_BATCH))
        max_blocks = -(-max_model_len // block_size)
        self.widths = width_ladder(max_blocks, max(1, MIN_WIDTH_TOKENS // block_size))
        self.layout = DecodeInputLayout(self.batch_sizes[-1], max_blocks)
        # int32 halves the per-step copy (the kernels take int32 or int64); slots index the whole cache.
        num_slots = kv_cache.shape[0] * block_size
        dtype = torch.int32 if num_slots < 2**31 else torch.int64
        on_cuda = self.device.type == "cuda"
        self._host = torch.zeros(self.layout.size, dtype=dtype, pin_memory=on_cuda)
        self._host_np = self._host.numpy()
        self._buf = torch.zeros(self.layout.size, dtype=dtype, device=self.device) if on_cuda else self._host
        # The host buffer is rewritten each step; the previous step's copy out of it must be done.
        self._copied = torch.cuda.Event() if on_cuda else None
        # (batch, width, with LoRA) -> the graph and its output
        self._graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, int, bool], torch.Tensor] = {}
        self.num_replays = 0

    # ---- which graph ----------------------------------------------------
    def plan(self, batch: list[ScheduledRequest]) -> tuple[int, int] | None:
        """The (batch, width) bucket a decode-only batch runs in; None if it must run eagerly."""
        if not batch or any(s.num_new_tokens != 1 for s in batch):
            return None
        b = bucket(len(batch), self.batch_sizes)
        need = max(s.request.num_computed_tokens // self.block_size + 1 for s in batch)
        w = bucket(need, self.widths)
        return None if b is None or w is None else (b, w)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    # ---- running --------------------------------------------------------
    @staticmethod
    def _with_lora(batch: list[ScheduledRequest]) -> bool:
        return any(s.request.lora_slot >= 0 for s in batch)

    def execute(self, batch: list[ScheduledRequest]) -> tuple[list[Request], torch.Tensor] | None:
        """Replay the graph for ``batch``; None (nothing done) when it has none: run it eagerly."""
        key = self.plan(batch)
        if key is None:
            return None
        graph_key = (*key, self._with_lora(batch))
        if graph_key not in self._graphs:
            return None
        sampled = self._load(batch, *key)
        self._graphs[graph_key].replay()
        self.num_replays += 1
        return sampled, self._logits(self._outputs[graph_key], key, len(batch), len(sampled))

    def run_padded(self, batch: list[ScheduledRequest]) -> tuple[list[Request], torch.Tensor] | None:
        """What ``execute`` computes, run eagerly on the same static, padded inputs (no graph).

        Checks padding and bucketing where graphs cannot run (on CPU, through
        the Triton interpreter), and is the reference when a replay looks wrong."""
        key = self.plan(batch)
        if key is None:
            return None
        lora = self._with_lora(batch)
        if lora and self.lora_slots is None:
            return None
        sampled = self._load(batch, *key)
        return sampled, self._logits(self._forward(*key, lora), key, len(batch), len(sampled))

    def _load(self, batch: list[ScheduledRequest], b: int, w: int) -> list[Request]:
        bs = self.block_size
        tokens, positions, slots, rows, sample_rows, sampled, lora_rows = [], [], [], [], [], [], []
        for i, s in enumerate(batch):
            req = s.request
            pos = req.num_computed_tokens
            blocks = req.block_ids[: pos // bs + 1]
            tokens.append(req.all_token_ids[pos])
            positions.append(pos)
            slots.append(blocks[-1] * bs + pos % bs)
            rows.append(blocks)
            lora_rows.append(req.lora_slot)
            if s.samples:
                sample_rows.append(i)
                sampled.append(req)
        if self._copied is not None:
            self._copied.synchronize()
        used = self.layout.pack(self._host_np, b, w, tokens, positions, slots, rows, sample_rows, lora_rows)
        if self._buf is not self._host:
            self._buf[:used].copy_(self._host[:used], non_blocking=True)
            self._copied.record()
        return sampled

    def _forward(self, b: int, w: int, lora: bool = False) -> torch.Tensor:
        v = self.layout.views(self._buf, b, w)
        meta = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=v.slot_mapping,
            num_decode_tokens=b,
            decode_block_tables=v.block_table,
            decode_context_lens=v.context_lens,
            prefill_block_tables=None,
            prefill_cu_seqlens_q=None,
            prefill_context_lens=None,
        )
        if lora:  # the gathered kernels over every row, padding (-1) included: one graph for any adapters
            meta.lora = LoRABatch(self.lora_slots, v.lora_rows)
        return self.model(v.input_ids, v.positions, meta)

    def _logits(self, hidden: torch.Tensor, key: tuple[int, int], n: int, num_sampled: int) -> torch.Tensor:
        # Logits stay outside the graph: the lm_head runs on the real sampled
        # rows only, exactly as in the eager runner, and the graph's output is
        # [b, hidden] instead of [b, vocab] in fp32 per captured graph.
        if num_sampled == 0:
            return hidden.new_empty(0)
        if num_sampled == n:
            return self.model.compute_logits(hidden[:n])
        rows = self.layout.views(self._buf, *key).sample_rows[:num_sampled]
        return self.model.compute_logits(hidden.index_select(0, rows))

    # ---- capture --------------------------------------------------------
    def capture(self, log: Callable[[str], None] | None = None) -> CudaGraphRunner:
        """Capture every (batch, width) graph, largest first so later ones reuse its memory pool."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        sets = (False, True) if self.lora_slots is not None else (False,)
        keys = sorted(((b, w, lora) for b in self.batch_sizes for w in self.widths for lora in sets), reverse=True)
        if self.lora_slots is not None:
            self.lora_slots.allocate()
        if log:
            log(f"capturing {len(keys)} CUDA graphs for decode: batch {self.batch_sizes[0]}-{self.batch_sizes[-1]}"
                f" x block-table width {self.widths[0]}-{self.widths[-1]} blocks"
                + (" x with and without LoRA" if len(sets) == 2 else ""))
        t0 = time.monotonic()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        # torch.cuda.graph runs gc.collect() on entry; with the engine's objects
        # frozen out of the collector that costs microseconds instead of tens of
        # milliseconds per graph.
        gc.collect()
        gc.freeze()
        try:
            with torch.inference_mode(), torch.cuda.device(self.device):
                for i, (b, w, lora) in enumerate(keys):
                    self._capture_one(b, w, lora, pool)
                    if log and (i + 1) % max(1, len(keys) // 10) == 0 and i + 1 < len(keys):
                        log(f"  {i + 1}/{len(keys)} graphs")
                torch.cuda.synchronize(self.device)
        finally:
            gc.unfreeze()
        if log:
            used = (free_before - torch.cuda.mem_get_info(self.device)[0]) / (1 << 20)
            log(f"captured {len(keys)} CUDA graphs in {time.monotonic() - t0:.1f}s ({used:.0f} MiB)")
        return self

    def _capture_one(self, b: int, w: int, lora: bool, pool) -> None:
        # Inputs of an all-padding batch: no cache writes, every read in the null block, no adapter.
        used = self.layout.pack(self._host_np, b, w, [0] * b, [0] * b, [-1] * b, [[0]] * b, [])
        self._buf[:used].copy_(self._host[:used])
        # One eager run first: triton compiles a kernel per specialisation at its
        # first launch, which must not happen inside a capture.
        self._forward(b, w, lora)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self._forward(b, w, lora)
        self._graphs[(b, w, lora)] = graph
        self._outputs[(b, w, lora)] = out


def _stderr(msg: str) -> None:
    print(f"[pdserve] {msg}", file=sys.stderr, flush=True)


def capture_decode_graphs(config, model: LlamaForCausalLM, kv_cache: torch.Tensor, max_model_len: int,
                          lora_slots: LoRASlots | None = None) -> CudaGraphRunner | None:
    """The engine's graph runner: captured on CUDA with the Triton ops unless ``enforce_eager``; else None.
    With ``lora_slots``, also the graphs of batches with adapters."""
    if config.enforce_eager or kv_cache.device.type != "cuda":
        return None
    if model.ops.name != "triton":
        _stderr(f"CUDA graphs off: the {model.ops.name} kernel backend is not graph-safe (use --kernels triton)")
        return None
    runner = CudaGraphRunner(model, kv_cache, config.block_size, config.max_num_seqs, max_model_len, lora_slots)
    return runner.capture(_stderr)
