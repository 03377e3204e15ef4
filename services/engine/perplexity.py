"""Perplexity of an engine's model on a fixed text, to check that a quantized model (weights or
KV cache) still computes the same function.

The text is one that every Python installation has offline: the topic pages of the Python
Language Reference that CPython ships for ``help()`` (``pydoc_data.topics``), in sorted key
order, cut at ``tokens`` tokens. Its exact wording moves a little between Python releases,
so compare perplexities measured in one run (the bench records the Python version).

The text goes through the engine's own model, kernels and KV-cache layout in chunks, exactly
as a chunked prefill does (each chunk attends to the cached KV of the ones before), into a
KV tensor of its own, so the engine's block pool is not touched; every position's logits
give the log-likelihood of the next token.
"""

from __future__ import annotations

import math

import torch

from services.engine.attention_metadata import AttentionMetadata
from services.engine.kv_cache import allocate_kv_cache

TEXT_SOURCE = "pydoc_data.topics (the Python Language Reference topics shipped with CPython), sorted by key"


def reference_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def text_tokens(tokenizer, tokens: int = 4096) -> list[int]:
    """The first ``tokens`` + 1 token ids of the reference text (``tokens`` predictions)."""
    ids = tokenizer.encode(reference_text())
    if len(ids) < tokens + 1:
        raise ValueError(f"the reference text has only {len(ids)} tokens")
    return ids[: tokens + 1]


@torch.inference_mode()
def perplexity(engine, token_ids: list[int], chunk: int = 512, after_chunk=None) -> float:
    """exp(mean negative log-likelihood) of ``token_ids[1:]`` given the tokens before each.

    ``after_chunk(kv, num_blocks)``, if given, may rewrite the first ``num_blocks`` blocks of the
    KV (ids 1..num_blocks) after each chunk: the next chunk then attends to that context (the
    spill-tier probe round-trips it through int8, as a restore from the spill tier would)."""
    n = len(token_ids)
    if n < 2:
        raise ValueError("perplexity needs at least two tokens")
    positions_max = engine.model.cos_sin_cache.shape[0]  # the model's context (its own KV here, not the pool's)
    if n > positions_max:
        raise ValueError(f"{n} tokens exceed the model's context of {positions_max}")
    bs = engine.config.block_size
    blocks = -(-n // bs)
    kv = allocate_kv_cache(engine.kv_spec, blocks + 1, engine.config.device)  # block 0: the null block
    dev = kv.device
    table = torch.arange(1, blocks + 1, dtype=torch.int32, device=dev)[None]
    model = engine.model
    nll, count = 0.0, 0
    for start in range(0, n - 1, chunk):
        end = min(start + chunk, n - 1)  # positions [start, end) predict tokens [start + 1, end + 1)
        positions = torch.arange(start, end, device=dev)
        meta = AttentionMetadata(
            kv_cache=kv, slot_mapping=positions + bs, num_decode_tokens=0, decode_block_tables=None,
            decode_context_lens=None, prefill_block_tables=table,
            prefill_cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32, device=dev),
            prefill_context_lens=torch.tensor([end], dtype=torch.int32, device=dev))
        hidden = model(torch.tensor(token_ids[start:end], device=dev), positions, meta)
        logits = model.compute_logits(hidden).float()
        targets = torch.tensor(token_ids[start + 1 : end + 1], device=dev)
        nll -= logits.log_softmax(-1).gather(1, targets[:, None]).sum().item()
        count += end - start
        if after_chunk is not None:
            after_chunk(kv, end // bs)
    return math.exp(nll / count)
