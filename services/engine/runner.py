"""Turns a SchedulerOutput into tensors, runs the model, returns logits of the rows that sample.

A request that verifies draft tokens gets logits for its last token and every draft (one row
each, in order); every other sampling request gets one row.

The runner owns the KV-cache tensor (the block pool only knows ids). Single-token
steps (decodes, and one-token prompt tails after a prefix hit) go first and use
the decode attention path; longer chunks follow and use the prefill path.
"""

from __future__ import annotations

import torch

from services.engine.attention_metadata import AttentionMetadata
from services.engine.lora_slots import LoRABatch
from services.engine.model import LlamaForCausalLM
from services.engine.request import Request
from services.engine.scheduler import ScheduledRequest, SchedulerOutput


def _block_table(rows: list[list[int]], device) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=device)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int, device: str):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = torch.device(device)
        # Set by the engine on CUDA (services.engine.cuda_graph): replays decode-only steps.
        self.cuda_graphs = None
        # Set by the engine when it serves LoRA adapters (services.engine.lora_slots.LoRASlots)
        self.lora_slots = None

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks' KV, every layer (a fork's partial block: services/engine/choices.py)."""
        if pairs:
            src, dst = zip(*pairs)
            self.kv_cache[list(dst)] = self.kv_cache[list(src)]

    def _prepare(self, batch: list[ScheduledRequest]):
        bs = self.block_size
        # Single-token rows use the decode path. So does a speculative request's verification:
        # its last token and its drafts are consecutive decode rows of one sequence, row j seeing
        # the context up to its own position (every row's K/V is written before any row attends),
        # which is causal attention over the chunk, computed as a plain decode step computes it.
        decodes = [s for s in batch if s.num_new_tokens == 1 or s.spec_token_ids]
        prefills = [s for s in batch if s.num_new_tokens > 1 and not s.spec_token_ids]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sampled: list[Request] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        lora_rows: list[int] = []  # the adapter slot of every row (-1: the base model)
        for s in decodes + prefills:
            req, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            ids.extend(req.all_token_ids[start : start + n - len(s.spec_token_ids)])
            ids.extend(s.spec_token_ids)
            pos = range(start, start + n)
            positions.extend(pos)
            lora_rows.extend([req.lora_slot] * n)
            blocks = req.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in pos)
            if s.spec_token_ids:  # every row is scored: the sampler verifies each draft against it
                sample_rows.extend(range(len(ids) - n, len(ids)))
                sampled.append(req)
            elif s.samples:
                sample_rows.append(len(ids) - 1)
                sampled.append(req)
            if s.num_new_tokens == 1 or s.spec_token_ids:
                for p in pos:
                    decode_tables.append(blocks[: p // bs + 1])
                    decode_lens.append(p + 1)
        dev = self.device
        meta = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decode_tokens=len(decode_lens),
            decode_block_tables=None,
            decode_context_lens=None,
            prefill_block_tables=None,
            prefill_cu_seqlens_q=None,
            prefill_context_lens=None,
        )
        if decodes:
            meta.decode_block_tables = _block_table(decode_tables, dev)
            meta.decode_context_lens = torch.tensor(decode_lens, dtype=torch.int32, device=dev)
        if prefills:
            ends = [s.request.num_computed_tokens + s.num_new_tokens for s in prefills]
            meta.prefill_block_tables = _block_table(
                [s.request.block_ids[: -(-e // bs)] for s, e in zip(prefills, ends)], dev
            )
            cu = [0]
            for s in prefills:
                cu.append(cu[-1] + s.num_new_tokens)
            meta.prefill_cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=dev)
            meta.prefill_context_lens = torch.tensor(ends, dtype=torch.int32, device=dev)
        if self.lora_slots is not None and any(slot >= 0 for slot in lora_rows):
            meta.lora = LoRABatch(self.lora_slots, torch.tensor(lora_rows, dtype=torch.int32, device=dev))
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        return input_ids, pos_t, meta, sample_rows, sampled

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[list[Request], torch.Tensor]:
        if self.cuda_graphs is not None:  # None: a step it has no graph for (services/engine/cuda_graph.py)
            replayed = self.cuda_graphs.execute(sched.scheduled)
            if replayed is not None:
                return replayed
        input_ids, positions, meta, sample_rows, sampled = self._prepare(sched.scheduled)
        hidden = self.model(input_ids, positions, meta)
        if not sampled:
            return [], hidden.new_empty(0)
        rows = torch.tensor(sample_rows, device=hidden.device)
        return sampled, self.model.compute_logits(hidden.index_select(0, rows))
