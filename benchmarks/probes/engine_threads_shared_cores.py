"""Batch-1 decode of the engine alone at 2 torch threads, then 1, then 2 again, in one process.

Why bench hops' "engine alone" batch-1 figure collapsed on the shared 2-core machine: run it
while other processes keep a core busy and compare the thread counts (it prints tok/s and the
1-minute load average). Usage: PYTHONPATH=. python benchmarks/probes/engine_threads_shared_cores.py
"""

import os
import time

import torch

from services.bench.hops import prompts
from services.config import EngineConfig
from services.engine.bench import pdserve_decode_b1
from services.engine.engine import Engine

engine = Engine(EngineConfig(dtype="bf16"))
prompt = engine.tokenizer.encode(prompts(99, 1)[0])[:64]
pdserve_decode_b1(engine, prompt, 8, "warm")
for threads in (2, 1, 2):
    torch.set_num_threads(threads)
    tok_s = pdserve_decode_b1(engine, prompt, 48, f"b{threads}-{time.time()}")
    print(f"threads {threads}: {tok_s:.1f} tok/s (load average {os.getloadavg()[0]:.1f})")
