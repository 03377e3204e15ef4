"""Probe: where a constrained batch-8 decode step's grammar time goes.

    PYTHONPATH=. python benchmarks/probes/structured_step.py

Eight requests, each with one of the first eight bench schemas, greedy, 48 tokens, on the
default model in bf16. Wraps grammar_masks.StructuredDecoding to time, per step: ``fill``
(llguidance filling the bitmasks and unpacking them, on the helper thread, during the forward),
``wait`` (the sampler waiting for that job after the forward) and ``expand`` (turning it into the
per-row blocked tensor). It found the first version's expansion (torch shifts over
[8, 1536, 32] int32) at 196 ms median per step on the shared 2-core machine, against 0.19 ms
for numpy's unpackbits on the helper thread (BENCHMARKS.md, bench structured).
"""

from __future__ import annotations

import time

import torch

from services.config import EngineConfig
from services.engine import grammar_masks as gm
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams
from services.engine.structured_bench import _prompt, load_schemas
from services.engine.structured_output import StructuredOutput


def main() -> None:
    engine = Engine(EngineConfig(dtype="bf16", kv_cache_bytes=256 << 20, max_num_seqs=8))
    stats: dict[str, list[float]] = {"fill": [], "wait": [], "expand": []}
    fill, masks = gm.StructuredDecoding._fill, gm.StructuredDecoding.masks

    def timed_fill(self, rows, bitmask):
        t0 = time.perf_counter()
        out = fill(self, rows, bitmask)
        stats["fill"].append(time.perf_counter() - t0)
        return out

    def timed_masks(self, job, reqs, vocab, device):
        t0 = time.perf_counter()
        if job is not None:
            job.result()
        stats["wait"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = masks(self, job, reqs, vocab, device)
        stats["expand"].append(time.perf_counter() - t0)
        return out

    gm.StructuredDecoding._fill, gm.StructuredDecoding.masks = timed_fill, timed_masks
    with torch.inference_mode():
        for i, case in enumerate(load_schemas()[:8]):
            engine.add_request(f"r{i}", _prompt(engine.tokenizer, case), SamplingParams(
                max_tokens=48, temperature=0, structured=StructuredOutput.json_schema(case["schema"])))
        while engine.has_unfinished():
            engine.step()
    for name, values in stats.items():
        v = sorted(values)
        print(f"{name:7} {len(v)} steps: p50 {v[len(v) // 2] * 1e3:.3f} ms, p90 {v[int(len(v) * 0.9)] * 1e3:.3f} ms, "
              f"max {v[-1] * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
