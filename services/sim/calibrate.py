"""``pdserve bench sim --calibrate``: measure this machine's worker costs for the simulator.

The simulator's CPU profile comes from here: the real engine (the default model,
bf16, one torch thread per worker as ``pdserve bench routing`` runs them) timed on

* prefill of N new tokens (N = 16 .. 2048), with and without a cached prefix
  ahead of them (a hit still attends over the cached tokens), fitted to
  ``a + b * tokens + c * tokens * context``;
* the engine's start (model load from the cached weights: a worker's cold start less
  Python's imports and registration);
* decode steps of B sequences at context L (B = 1 .. 64, L = 128 .. 1024),
  fitted to ``a + b * B + c * B * L`` (weights once per step, per-sequence
  work, attention over every cached token);

Times are the process's CPU seconds (one torch thread: the compute), not wall time: on a
machine shared with other jobs a thread waits for a core, and wall time counted that wait
as work (the 2026-11-25 points, timed by the wall at load 6-8, put 1,024 tokens at 2.4 s;
bench routing's workers spent under half that CPU per request). The simulator's shared
host (host.py) adds the waiting back from the cores the run actually had.

The fit and the raw points go into the calibration file (``--calibration-out``,
default ``services/sim/calibration.json``), beside the GPU profile, which is
derived from published H100 figures (see ``profiles.py``).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np


def _log(msg: str) -> None:
    print(f"[calibrate] {msg}", file=sys.stderr, flush=True)


def _prefill_s(engine, prompt: list[int], rid: str) -> float:
    from services.engine.sampling_params import SamplingParams

    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    t = time.process_time()
    while engine.has_unfinished():
        engine.step()
    return time.process_time() - t


def measure(repeats: int = 3, threads: int = 1) -> dict:
    import random

    import torch

    from services.config import EngineConfig
    from services.engine.engine import Engine
    from services.engine.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    started = time.perf_counter()
    engine = Engine(EngineConfig(max_num_batched_tokens=2048, long_prefill_chunk=2048, max_num_seqs=128))
    load_s = time.perf_counter() - started  # the model load of a worker's start (cached weights)
    _log(f"engine start (model load from the cache): {load_s:.2f} s")
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)

    def fresh(n):
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    with torch.inference_mode():
        _prefill_s(engine, fresh(256), "warm")
        prefill = []  # (new tokens, context incl. cached, seconds)
        for n in (16, 64, 128, 256, 512, 1024, 2048):
            for r in range(repeats):
                prefill.append((n, n, _prefill_s(engine, fresh(n), f"p{n}.{r}")))
            _log(f"prefill {n} tokens: {min(p[2] for p in prefill if p[0] == n) * 1e3:.1f} ms")
        for cached in (1024,):
            base = fresh(cached)
            _prefill_s(engine, base + fresh(16), f"seed{cached}")
            for n in (16, 64, 256):
                for r in range(repeats):
                    prefill.append((n, cached + n, _prefill_s(engine, base + fresh(n), f"h{cached}.{n}.{r}")))
                _log(f"prefill {n} tokens after {cached} cached: "
                     f"{min(p[2] for p in prefill if p[0] == n and p[1] == cached + n) * 1e3:.1f} ms")
        decode = []  # (batch, context, seconds per step)
        for ctx in (128, 512, 1024):
            for b in (1, 4, 16, 64):
                ids = [f"d{ctx}.{b}.{i}" for i in range(b)]
                for rid in ids:
                    engine.add_request(rid, fresh(ctx), SamplingParams(max_tokens=10_000, temperature=0,
                                                                        ignore_eos=True))
                while any(engine.requests[r].num_output_tokens == 0 for r in ids):
                    engine.step()
                steps = []
                for _ in range(8):
                    t = time.process_time()
                    engine.step()
                    steps.append(time.process_time() - t)
                for rid in ids:
                    engine.abort(rid)
                engine.step_outputs_discard()
                decode.append((b, ctx, float(np.median(steps))))
                _log(f"decode batch {b} context {ctx}: {decode[-1][2] * 1e3:.1f} ms/step")
    return {"prefill_points": prefill, "decode_points": decode, "threads": threads, "engine_start_s": load_s,
            "model": engine.model_name, "dtype": engine.config.dtype,
            "kv_bytes_per_block": engine.kv_spec.block_bytes, "kv_blocks_default": engine.block_pool.num_blocks,
            "block_size": engine.config.block_size}


def _relative_lstsq(rows: list[tuple], seconds: list[float]):
    """Least squares of the relative error: each point weighs by 1 / its time, so the many short steps
    a small batch takes are fitted as well as the long ones (a plain fit let batch 64's 0.3 s steps set
    batch 1's 39 ms step at 68 ms)."""
    a, b = np.array(rows, dtype=float), np.array(seconds, dtype=float)
    coef, *_ = np.linalg.lstsq(a / b[:, None], np.ones_like(b), rcond=None)
    return coef


def fit(points: dict) -> dict:
    """Fits of the two cost models (the minimum of the repeats of each point), in relative error."""
    best: dict = {}
    for n, ctx, s in points["prefill_points"]:
        best[(n, ctx)] = min(s, best.get((n, ctx), s))
    pa, pb, pc = _relative_lstsq([(1.0, n, n * ctx) for n, ctx in best], list(best.values()))
    da, db, dc = _relative_lstsq([(1.0, b, b * ctx) for b, ctx, _ in points["decode_points"]],
                                 [s for *_, s in points["decode_points"]])
    return {"prefill_s": {"base": max(float(pa), 0.0), "per_token": float(pb), "per_token_context": max(float(pc), 0.0)},
            "decode_step_s": {"base": float(da), "per_seq": max(float(db), 0.0),
                              "per_seq_context": max(float(dc), 0.0)}}


def into_profile(points: dict, calibration: str, note: str) -> dict:
    """Write the fit and the raw points into the calibration file's cpu profile; the profile returned."""
    from pathlib import Path

    path = Path(calibration)
    cal = json.loads(path.read_text())
    cpu = cal["profiles"]["cpu"]
    cpu.update(points["fit"])
    cpu["source"]["measured"] = note
    cpu["source"]["points"] = {"prefill [new tokens, context, CPU s]": points["prefill_points"],
                               "decode [batch, context, CPU s per step]": points["decode_points"]}
    path.write_text(json.dumps(cal, indent=1) + "\n")
    return cpu


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default="calibration-cpu.json", help="the raw points and the fit")
    parser.add_argument("--from-points", default=None, help="fit a saved points file instead of measuring")
    parser.add_argument("--into", default=None, metavar="CALIBRATION", help="also write the fit into this "
                        "calibration file's cpu profile (services/sim/calibration.json)")
    parser.add_argument("--note", default="python -m services.sim.calibrate", help="how it was measured (the source)")
    args = parser.parse_args()
    pts = json.loads(open(args.from_points).read()) if args.from_points else measure()
    pts["fit"] = fit(pts)
    with open(args.out, "w") as f:
        json.dump(pts, f, indent=1)
    if args.into:
        into_profile(pts, args.into, args.note)
    _log(json.dumps(pts["fit"]))
