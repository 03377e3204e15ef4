"""Probe: batch-1 decode with the fused decode driver on and off, alternating in one process.

    PYTHONPATH=. python benchmarks/probes/fused_decode.py [none,int8,gguf] [threads]

For each weight format, four rounds of 64 greedy tokens after a 64-token prompt with
``PDSERVE_FUSED_DECODE=0`` (the model's Python path) then ``1`` (kernels/decode_layers_cpu.py),
on one engine; prints the median CPU and wall milliseconds per token of each. CPU time per
token stays meaningful on a busy machine (wall time does not); with 1 thread it is the work
the step costs, which is what the driver removes.
"""

from __future__ import annotations

import gc
import os
import sys
import time

import torch

from services.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> None:
    formats = (sys.argv[1] if len(sys.argv) > 1 else "none,int8,gguf").split(",")
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    prompt = list(range(100, 164))
    for fmt in formats:
        engine = Engine(EngineConfig(dtype="bf16", quantization=None if fmt == "none" else fmt, max_num_seqs=8,
                                     kv_cache_bytes=256 << 20))
        runs: dict[str, list[tuple[float, float]]] = {"0": [], "1": []}
        for rnd in range(4):
            for fused in ("0", "1"):
                os.environ["PDSERVE_FUSED_DECODE"] = fused
                engine.model._fused_key = None  # built again under the setting
                rid = f"{fused}-{rnd}"
                engine.add_request(rid, prompt, SamplingParams(max_tokens=65, temperature=0, ignore_eos=True))
                while engine.requests[rid].num_output_tokens == 0:
                    engine.step()
                wall, cpu = time.perf_counter(), time.process_time()
                while engine.has_unfinished():
                    engine.step()
                runs[fused].append(((time.process_time() - cpu) / 64 * 1e3, (time.perf_counter() - wall) / 64 * 1e3))
        cols = {name: (_median([c for c, _ in runs[k]]), _median([w for _, w in runs[k]]))
                for name, k in (("python path", "0"), ("fused", "1"))}
        print(f"{fmt}: " + " | ".join(f"{name} cpu {c:.2f} / wall {w:.2f} ms per token" for name, (c, w) in cols.items())
              + f" | cpu ratio {cols['python path'][0] / cols['fused'][0]:.2f}x", flush=True)
        del engine
        gc.collect()


if __name__ == "__main__":
    main()
