"""Turns a SchedulerOutput into tensors, runs the model, returns logits of the rows that sample.

The runner owns the KV-cache tensor (the block pool only knows ids). Single-token
steps (decodes, and one-token prompt tails after a prefix hit) go first and use
the decode attention path; longer chunks follow and use the prefill path.
"""

from __future__ import annotations

import torch

from services.engine.attention_metadata import AttentionMetadata
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

    def _prepare(self, batch: list[ScheduledRequest]):
        bs = self.block_size
        decodes = [s for s in batch if s.num_new_tokens == 1]
        prefills = [s for s in batch if s.num_new_tokens > 1]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sampled: list[Request] = []
        for s in decodes + prefills:
            req, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            ids.extend(req.all_token_ids[start : start + n])
            pos = range(start, start + n)
            positions.extend(pos)
            blocks = req.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in pos)
            if s.samples:
                sample_rows.append(len(ids) - 1)
                sampled.append(req)
        dev = self.device
        meta = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decode_tokens=len(decodes),
            decode_block_tables=None,
            decode_context_lens=None,
            prefill_block_tables=None,
            prefill_cu_seqlens_q=None,
            prefill_context_lens=None,
        )
        if decodes:
            meta.decode_block_tables = _block_table(
                [s.request.block_ids[: -(-(s.request.num_computed_tokens + 1) // bs)] for s in decodes], dev
            )
            meta.decode_context_lens = torch.tensor(
                [s.request.num_computed_tokens + 1 for s in decodes], dtype=torch.int32, device=dev
            )
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
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        return input_ids, pos_t, meta, sample_rows, sampled

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[list[Request], torch.Tensor]:
        if self.cuda_graphs is not None:
            replayed = self.cuda_graphs.execute(sched.scheduled)
            if replayed is not None:
                return replayed
        input_ids, positions, meta, sample_rows, sampled = self._prepare(sched.scheduled)
        hidden = self.model(input_ids, positions, meta)
        if not sampled:
            return [], hidden.new_empty(0)
        rows = torch.tensor(sample_rows, device=hidden.device)
        return sampled, self.model.compute_logits(hidden.index_select(0, rows))
