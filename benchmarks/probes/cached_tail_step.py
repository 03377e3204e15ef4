"""Probe: what the engine step that computes a cached prompt's tail costs, against a decode step.

    PYTHONPATH=. python benchmarks/probes/cached_tail_step.py [none|gguf] [rounds]

A repeated prompt on the decode worker that holds its full blocks is prefilled there: its next
step computes only the last partial block (a few tokens over the cached prefix) beside the
running batch's decodes (issue 27; ``pdserve bench hops`` saw that step cost several decode
steps). Here, on one engine and one thread, per round: a fresh prompt of 40-120 words (caching
it), then at batch 1 and beside 16 running decodes, the same prompt again; per step, the CPU
time (``time.process_time``: on one thread, the work the step costs, which stays meaningful on a
busy machine) of the step that takes the newcomer and of the plain decode step after it, with
the newcomer's step three ways, alternating: ``python``, on the model's per-layer Python path (as
before the first fix: the fused driver took decode-only steps); ``fused``, through the fused
driver (kernels/decode_layers_cpu.py), computing its whole tail; ``tail``, the driver with the
KV of its tail copied from the block the fresh prompt left (KVManager._copy_tail: one token left
to compute). Prints the medians, and by phase (schedule, forward, logits, sample) for batch 1.
"""

from __future__ import annotations

import collections
import random
import sys
import time

import torch

from services.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams

WORDS = ("river stone light garden window paper engine market silver forest music winter harbor signal letter "
         "mountain yellow planet bridge candle orange theory coffee island rocket thunder velvet marble").split()


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else 0.0


class Timed:
    """CPU seconds spent in a few of the engine's calls during one step."""

    def __init__(self, engine: Engine):
        self.seconds: collections.Counter = collections.Counter()
        model = engine.model
        for owner, name, label in ((engine.scheduler, "schedule", "schedule"), (model, "forward", "forward"),
                                   (model, "compute_logits", "logits"), (engine, "_sample", "sample")):
            setattr(owner, name, self._wrap(label, getattr(owner, name)))

    def _wrap(self, label, fn):
        def timed(*args, **kwargs):
            started = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.process_time() - started
        return timed


def main() -> None:
    fmt = sys.argv[1] if len(sys.argv) > 1 else "gguf"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    torch.set_num_threads(1)
    engine = Engine(EngineConfig(dtype="bf16", quantization=None if fmt == "none" else fmt, max_num_seqs=64,
                                 kv_cache_bytes=256 << 20))
    tok, timed, rng = engine.tokenizer, Timed(engine), random.Random(0)
    driver = engine.model._decode_layers(engine.kv_cache)
    if driver is None:
        sys.exit("the fused driver does not take this model here (no AVX-512?)")
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    background = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)

    def step() -> tuple[float, dict]:
        timed.seconds.clear()
        started = time.process_time()
        engine.step()
        return time.process_time() - started, dict(timed.seconds)

    results: dict[tuple, list] = collections.defaultdict(list)
    tails = []
    copy_blocks = engine.kv.copy_blocks
    paths = ("python", "fused", "tail")
    for rnd in range(rounds):
        for batch in (1, 17):
            for path in paths:
                driver.prefill = path != "python"  # False: steps with a prefill chunk take the Python path
                engine.kv.copy_blocks = copy_blocks if path == "tail" else None  # None: no tail copy
                prompt = tok.encode(f"{rnd} {batch} {path}: " + " ".join(rng.choice(WORDS)
                                                                        for _ in range(rng.randint(40, 120))))
                others = [f"bg-{rnd}-{batch}-{path}-{i}" for i in range(batch - 1)]
                for i, rid in enumerate(others):
                    engine.add_request(rid, tok.encode(f"{rid} {i} " + " ".join(WORDS)), background)
                rid = f"p-{rnd}-{batch}-{path}"
                engine.add_request(rid + "-fresh", prompt, params)
                while rid + "-fresh" in engine.requests:  # the fresh prompt caches its blocks
                    engine.step()
                engine.add_request(rid, prompt, params)
                newcomer, phases = step()  # the running decodes and the newcomer's tail
                decode, _ = step()  # the same batch's next step: decodes only
                results[(batch, path, "newcomer")].append(newcomer)
                results[(batch, path, "decode")].append(decode)
                if batch == 1:
                    results[(path, "phases")].append(phases)
                tails.append(len(prompt) % engine.config.block_size)
                for r in others + [rid]:
                    if r in engine.requests:
                        engine.abort(r)
                engine.take_pending_outputs()
    print(f"{fmt} weights, 1 thread, {rounds} rounds; the newcomer's uncached tail: "
          f"{min(tails)}-{max(tails)} tokens (median {_median(tails)})")
    for batch in (1, 17):
        for path in paths:
            n, d = _median(results[(batch, path, "newcomer")]), _median(results[(batch, path, "decode")])
            print(f"batch {batch - 1:2d} + newcomer, its step on the {path:6s} path: {n * 1e3:6.2f} ms CPU; "
                  f"the next (decode-only) step {d * 1e3:6.2f} ms; ratio {n / d:.2f}")
    for path in paths:
        rows = results[(path, "phases")]
        print(f"batch 1, newcomer's step by phase ({path}): " + ", ".join(
            f"{k} {_median([r.get(k, 0.0) for r in rows]) * 1e3:.2f}" for k in ("schedule", "forward", "logits", "sample"))
            + " ms")


if __name__ == "__main__":
    main()
