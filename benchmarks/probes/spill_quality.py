"""Probe: what int8 spill does to the model's output (issue 21: "int8 spill is lossy: measure").

    PYTHONPATH=. python benchmarks/probes/spill_quality.py [chunk ...]

A conversation that returns finds its history restored from the spill tier: with
``--kv-spill-dtype int8`` the history's KV has been through int8 rows (kernels/kv_int8.py)
while the new turn's KV is computed fresh. Perplexity over the fixed offline text
(services/engine/perplexity.py, 4,096 tokens) with the KV of every full block before each chunk
round-tripped through the spill store's int8 rows, against the same engine without, for each
chunk size (512: turns of 512 new tokens; 64: turns of 64, nearly all the context restored);
bf16 cache, default model. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys

import torch

from kernels.kv_int8 import dequantize_rows, quantize_rows
from services.config import EngineConfig
from services.engine.engine import Engine
from services.engine.perplexity import perplexity, text_tokens


def _through_int8():
    """A hook that round-trips each full block once, when it is complete (the spill tier holds
    whole blocks; a partial block is computed again by the next chunk, so it never spills)."""
    done = [0]

    def hook(kv: torch.Tensor, num_blocks: int) -> None:
        if num_blocks > done[0]:
            part = kv[1 + done[0]:num_blocks + 1]
            part.copy_(dequantize_rows(quantize_rows(part), kv.dtype))
            done[0] = num_blocks

    return hook


def main() -> None:
    chunks = [int(c) for c in sys.argv[1:]] or [512, 64]
    engine = Engine(EngineConfig(dtype="bf16", kv_cache_bytes=64 << 20))
    ids = text_tokens(engine.tokenizer, 4096)
    base = {c: perplexity(engine, ids, chunk=c) for c in chunks}
    spilled = {c: perplexity(engine, ids, chunk=c, after_chunk=_through_int8()) for c in chunks}
    print(json.dumps({"tokens": len(ids),
                      "ppl_bf16": {c: round(base[c], 4) for c in chunks},
                      "ppl_int8_spilled_context": {c: round(spilled[c], 4) for c in chunks},
                      "ratio": {c: round(spilled[c] / base[c], 4) for c in chunks}}))


if __name__ == "__main__":
    main()
