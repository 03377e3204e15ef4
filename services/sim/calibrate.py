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

The fit and the raw points go into the calibration file (``--into``, the profile
``--profile``, default ``cpu``), beside the GPU profiles.

On a GPU (``--device cuda``, e.g. ``--model dummy:llama-3.1-8b``) the same points are
taken by the wall clock (each step ends in the sampler's copy to the host, so a step's
wall time is the device's), with CUDA graphs as served, over a grid sized for a GPU
(prompts up to 8,192 tokens, batches up to 128 at contexts up to 8,192). What one
engine does not measure (the KV transfer between machines, a container's cold start)
comes from ``--base``, another profile of the file, and the profile's source says which
fields are measured and which are not.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np


def _log(msg: str) -> None:
    print(f"[calibrate] {msg}", file=sys.stderr, flush=True)


# (prefill sizes, decode (context, batches) grid, prompt tokens per step) per device kind: a GPU
# step of 128 sequences costs about what one of 8 does, so its grid goes further
GRIDS = {
    "cpu": ((16, 64, 128, 256, 512, 1024, 2048), ((128, (1, 4, 16, 64)), (512, (1, 4, 16, 64)),
                                                  (1024, (1, 4, 16, 64))), 2048),
    "cuda": ((16, 64, 256, 512, 1024, 2048, 4096, 8192), ((512, (1, 8, 32, 128)), (2048, (1, 8, 32, 128)),
                                                          (8192, (1, 8))), 8192),
}


def _prefill_s(engine, prompt: list[int], rid: str, clock) -> float:
    from services.engine.sampling_params import SamplingParams

    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    t = clock()
    while engine.has_unfinished():
        engine.step()
    return clock() - t


def measure(repeats: int = 3, threads: int = 1, model: str | None = None, device: str = "cpu") -> dict:
    import random

    import torch

    from services.engine.sampling_params import SamplingParams

    kind = "cuda" if device.startswith("cuda") else "cpu"
    prefill_sizes, decode_grid, step_tokens = GRIDS[kind]
    # CPU: the thread's CPU time (the compute; see above); GPU: the wall clock, the step's own end syncing
    clock = time.perf_counter if kind == "cuda" else time.process_time
    torch.set_num_threads(threads)
    started = time.perf_counter()
    engine = calibration_engine(model, device)
    load_s = time.perf_counter() - started  # the model load of a worker's start (cached weights)
    _log(f"engine start (model load from the cache): {load_s:.2f} s")
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)

    def fresh(n):
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    with torch.inference_mode():
        _prefill_s(engine, fresh(256), "warm", clock)
        prefill = []  # (new tokens, context incl. cached, seconds)
        for n in prefill_sizes:
            for r in range(repeats):
                prefill.append((n, n, _prefill_s(engine, fresh(n), f"p{n}.{r}", clock)))
            _log(f"prefill {n} tokens: {min(p[2] for p in prefill if p[0] == n) * 1e3:.1f} ms")
        for cached in (1024,):
            base = fresh(cached)
            _prefill_s(engine, base + fresh(16), f"seed{cached}", clock)
            for n in (16, 64, 256):
                for r in range(repeats):
                    prefill.append((n, cached + n, _prefill_s(engine, base + fresh(n), f"h{cached}.{n}.{r}", clock)))
                _log(f"prefill {n} tokens after {cached} cached: "
                     f"{min(p[2] for p in prefill if p[0] == n and p[1] == cached + n) * 1e3:.1f} ms")
        decode = []  # (batch, context, seconds per step)
        for ctx, batches in decode_grid:
            for b in batches:
                ids = [f"d{ctx}.{b}.{i}" for i in range(b)]
                for rid in ids:
                    engine.add_request(rid, fresh(ctx), SamplingParams(max_tokens=10_000, temperature=0,
                                                                        ignore_eos=True))
                while any(engine.requests[r].num_output_tokens == 0 for r in ids):
                    engine.step()
                steps = []
                for _ in range(8):
                    t = clock()
                    engine.step()
                    steps.append(clock() - t)
                for rid in ids:
                    engine.abort(rid)
                engine.step_outputs_discard()
                decode.append((b, ctx, float(np.median(steps))))
                _log(f"decode batch {b} context {ctx}: {decode[-1][2] * 1e3:.1f} ms/step")
    return {"prefill_points": prefill, "decode_points": decode, "threads": threads, "engine_start_s": load_s,
            "model": engine.model_name, "dtype": engine.config.dtype, "device": _device_name(device),
            "timed_by": "wall clock" if kind == "cuda" else "the thread's CPU time",
            "kv_bytes_per_block": engine.kv_spec.block_bytes, "kv_blocks_default": engine.block_pool.num_blocks,
            "block_size": engine.config.block_size, "prefill_step_tokens": step_tokens}


def calibration_engine(model: str | None, device: str):
    """The engine as the calibration times it: whole prompts up to the device kind's step budget (GRIDS)."""
    from services.config import EngineConfig
    from services.engine.engine import Engine

    step_tokens = GRIDS["cuda" if device.startswith("cuda") else "cpu"][2]
    return Engine(EngineConfig(model=model, device=device, max_num_batched_tokens=step_tokens,
                               long_prefill_chunk=step_tokens, max_num_seqs=128))


def _device_name(device: str) -> str:
    import platform

    import torch

    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"{platform.processor() or platform.machine()}, torch {torch.__version__}"


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


# what a profile measured on one engine keeps of its --base: costs outside one engine
_FROM_BASE = ("transfer", "cold_start_s", "warm_start_s", "max_num_seqs")


def into_profile(points: dict, calibration: str, note: str, profile: str = "cpu", base: str | None = None) -> dict:
    """Write the fit and the raw points into the calibration file's ``profile``; the profile returned.

    A profile the file does not have yet starts as a copy of ``base``, whose KV capacity and block
    shape are then replaced by the measured engine's, and whose source names what stays ``base``'s."""
    import copy
    from pathlib import Path

    path = Path(calibration)
    cal = json.loads(path.read_text())
    profiles = cal["profiles"]
    if profile not in profiles:
        if base not in profiles:
            raise ValueError(f"profile {profile!r} is new: --base must name one of {', '.join(sorted(profiles))} "
                             "for what one engine does not measure (KV transfer, cold start)")
        entry = copy.deepcopy(profiles[base])
        entry["source"] = {f"kept from {base}": ", ".join(_FROM_BASE), base: profiles[base]["source"]}
        entry["kv_blocks"] = points["kv_blocks_default"]
        entry["block_size"] = points["block_size"]
        entry["kv_bytes_per_token"] = points["kv_bytes_per_block"] // points["block_size"]
        profiles[profile] = entry
    entry = profiles[profile]
    entry.update(points["fit"])
    if points.get("timed_by") == "wall clock" and points.get("prefill_step_tokens"):
        # a GPU profile's prefill workers run the engine's steps as calibrated (whole prompts up to the step's
        # budget, several per step): the fit's base is the step's host-bound launches, paid once per step
        # whatever number of prompts it carries (benchmarks/probes/prefill_step_batching.py: 8 prompts of 16
        # tokens in one step took 27 ms on an H200, one took 17 ms). The CPU profile keeps the engine's served
        # defaults, which pdserve bench routing ran and the validation compares against
        entry["prefill_step_tokens"] = entry["prefill_chunk_tokens"] = points["prefill_step_tokens"]
    unit = "CPU s" if points.get("timed_by", "").endswith("CPU time") or "timed_by" not in points else "s"
    entry["source"]["measured"] = note + (f" ({points['model']}, {points['dtype']}, {points['device']}; engine "
                                          f"start {points['engine_start_s']:.1f} s)" if "device" in points else "")
    entry["source"]["points"] = {f"prefill [new tokens, context, {unit}]": points["prefill_points"],
                                 f"decode [batch, context, {unit} per step]": points["decode_points"]}
    path.write_text(json.dumps(cal, indent=1) + "\n")
    return entry


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default="calibration-cpu.json", help="the raw points and the fit")
    parser.add_argument("--from-points", default=None, help="fit a saved points file instead of measuring")
    parser.add_argument("--into", default=None, metavar="CALIBRATION", help="also write the fit into this "
                        "calibration file (services/sim/calibration.json), as the profile --profile")
    parser.add_argument("--profile", default="cpu", help="the profile written by --into (default cpu)")
    parser.add_argument("--base", default=None, help="for a profile the file does not have: the profile whose "
                        "KV transfer, cold start and max_num_seqs it keeps (e.g. h100)")
    parser.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--repeats", type=int, default=3, help="timings of each prefill point (the fastest is fitted)")
    parser.add_argument("--note", default="python -m services.sim.calibrate", help="how it was measured (the source)")
    args = parser.parse_args()
    try:
        pts = (json.loads(open(args.from_points).read()) if args.from_points
               else measure(repeats=args.repeats, model=args.model, device=args.device))
        pts["fit"] = fit(pts)
        with open(args.out, "w") as f:
            json.dump(pts, f, indent=1)
        if args.into:
            into_profile(pts, args.into, args.note, args.profile, args.base)
    except (ValueError, OSError) as exc:
        sys.exit(f"calibrate: {exc}")
    _log(json.dumps(pts["fit"]))
