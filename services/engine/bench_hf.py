"""HF transformers at its best on the engine bench's workload.

HF ``generate`` has no continuous batching; the best a user can do with it is static
batches of similar prompts: requests sorted by prompt length (length buckets, so a batch
pads little on the left), left-padded, each batch generating its longest target. Which
dtype is faster depends on the CPU (bf16 matmuls run on AMX tiles or ``vdpbf16ps``
where they exist, fp32 on FMAs), and so does the batch size, so the bench runs every
(dtype, batch size) asked for and the best is the baseline. Only target tokens count: the
tokens a batch generates past a request's target are padding.
"""

from __future__ import annotations

import sys
import time

import torch


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def batches(workload: list[tuple[list[int], int]], batch_size: int, bucketed: bool = True):
    """The workload in static batches of ``batch_size``: by prompt length when ``bucketed``
    (ties keep arrival order), else in arrival order."""
    order = sorted(workload, key=lambda r: len(r[0])) if bucketed else list(workload)
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def hf_mixed(model, workload, batch_size: int, pad_id: int, bucketed: bool = True) -> float:
    """Output tokens/s of the workload in static batches (left-padded, each batch generating
    its longest target)."""
    useful = 0
    t = time.perf_counter()
    for batch in batches(workload, batch_size, bucketed):
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        new = max(o for _, o in batch)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=pad_id)
        useful += sum(o for _, o in batch)
    return useful / (time.perf_counter() - t)


def hf_decode_b1(model, prompt: list[int], n: int, pad_id: int) -> float:
    """Batch-1 decode tokens/s after the first token: a run of n + 1 tokens less a run of 1."""
    ids = torch.tensor([prompt])
    kw = dict(do_sample=False, pad_token_id=pad_id)
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=1, **kw)
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=n + 1, min_new_tokens=n + 1, **kw)
    return n / (time.perf_counter() - t - t1)


def hf_best(weights_dir, workload, warmup, b1_prompt: list[int], decode_tokens: int, dtypes: list[str],
            batch_sizes: list[int], pad_id: int) -> dict:
    """Every (dtype, batch size) on the mixed workload and every dtype's batch-1 decode.

    Returns ``{"runs": [{dtype, batch_size, tok_s}], "decode_b1": {dtype: tok/s},
    "best": the fastest run, "best_decode_b1": {dtype, tok_s}}``."""
    from transformers import AutoModelForCausalLM

    from services.engine.kv_cache import dtype_from_name
    from services.config import EngineConfig

    runs, b1 = [], {}
    for name in dtypes:
        dtype = EngineConfig(dtype=name).dtype  # validates and normalises (bf16 -> bfloat16)
        model = AutoModelForCausalLM.from_pretrained(weights_dir, dtype=dtype_from_name(dtype)).eval()
        with torch.inference_mode():
            hf_mixed(model, warmup, 2, pad_id)
            _log(f"batch-1 decode: HF {dtype}")
            b1[dtype] = round(hf_decode_b1(model, b1_prompt, decode_tokens, pad_id), 1)
            for size in batch_sizes:
                _log(f"mixed workload: HF {dtype}, length-bucketed static batches of {size}")
                runs.append({"dtype": dtype, "batch_size": size,
                             "tok_s": round(hf_mixed(model, workload, size, pad_id), 1)})
                _log(f"  {runs[-1]['tok_s']} tok/s")
        del model
    best_b1 = max(b1, key=b1.get)
    return {"runs": runs, "decode_b1": b1, "best": max(runs, key=lambda r: r["tok_s"]) if runs else None,
            "best_decode_b1": {"dtype": best_b1, "tok_s": b1[best_b1]}}
