"""Probe: where a multi-LoRA decode step's time goes, per projection, against the base weights.

    PYTHONPATH=. python benchmarks/probes/lora_rank.py [rank=64] [batch=8] [threads=1] [rounds=5] [lora_dtype=bf16]

Part 1, the kernels: SmolLM2-135M's shapes (30 layers; hidden 576, q 576, k/v 192, MLP 1536),
bf16. ``batch`` rows, each with its own adapter slot (the case ``pdserve bench lora`` measures),
stacks for every layer as the engine holds them (kernels/lora_cpu.c's layout) in ``lora_dtype``
(bf16, int8 or int4: random codes and scales, kernels/lora_quant.py's layout; the bytes counted
are the codes', which is what the kernel streams). Before each timed
pass a 1 GiB buffer is read, so the pass reads its weights from DRAM as a step does (a step's
base weights and adapters together exceed the 504 MiB L3 this machine reports), not from a
cache the previous pass warmed. Per projection:

- ``base``: the base linear (kernels/linear_cpu.c, packed bf16) for the same rows;
- ``lora``: the gathered LoRA kernel; its ``shrink`` alone (the same call with empty output
  segments, so the expand does nothing); its ``expand`` nearly alone (the same call told the
  input has 32 columns, so the shrink reads 1/18 of A or less, counted in);
- the bytes each reads per step (base: the weight; LoRA: every row's own A and B at rank r) and
  the GB/s that makes;
- ``ceiling``: GB/s of a plain read of an fp32 buffer the size of the adapters (torch sum, one
  pass), roughly what a kernel bound by memory could reach on this machine.

Part 2, the engine (``engine``): the default model with ``batch`` random adapters of this rank,
CPU milliseconds per generated token of the same batch with every request on its own adapter,
on none, and on its adapter with every slot's rank set to 0 (the LoRA plumbing without the
kernel's reads): the kernel's share of a real step.

Prints one JSON object. Timings are medians over ``rounds`` passes over the layers; with one
thread they are the calling thread's CPU time (every kernel runs on it), which stays
meaningful on a busy machine where wall time does not; with more, wall time, and the LoRA
pass's process CPU time over its wall time (``lora_cpu_over_wall``: about the number of threads
that worked on it; the kernel splits a step's rows across OpenMP threads).
Run with threads 1 and 2 to see whether a second core raises the read rate on this machine.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from kernels import native
from kernels.linear_cpu import PackedLinear

LAYERS, H, Q, KV, INTER = 30, 576, 576, 192, 1536
# projection -> (input size, output segment bounds), as services/engine/lora_slots.py
SHAPES = {"qkv": (H, (0, Q, Q + KV, Q + 2 * KV)), "o": (Q, (0, H)), "gate_up": (H, (0, INTER, 2 * INTER)),
          "down": (INTER, (0, H))}


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


_FLUSH = None


def _flush() -> None:
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.ones(1 << 28)  # 1 GiB of fp32
    _FLUSH.sum()


def _timed(fn, rounds: int, clock) -> float:
    fn()
    times = []
    for _ in range(rounds):
        _flush()
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return _median(times)


def _stack(fmt: str, shape: tuple[int, ...], g) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A random stack of ``shape`` (elements) in ``fmt`` and its scales (kernels/lora_quant.py)."""
    from kernels.lora_quant import GROUP

    if fmt == "bf16":
        return torch.randn(*shape, generator=g).to(torch.bfloat16), None
    if fmt == "int8":
        return (torch.randint(-127, 128, shape, generator=g, dtype=torch.int8),
                None)  # per-row scales: made by the caller
    *lead, n = shape
    return (torch.randint(0, 256, (*lead, n // 2), generator=g, dtype=torch.uint8),
            (torch.rand(*lead, n // GROUP, generator=g) * 0.01).to(torch.bfloat16))


def _projection(lib, k: int, bounds: tuple[int, ...], rank: int, batch: int, rounds: int, clock, g,
                fmt: str = "bf16") -> dict:
    """One projection over the layers: base linear, LoRA, shrink alone, expand nearly alone."""
    from kernels.lora_quant import CODES, bytes_per_weight

    n, nseg = bounds[-1], len(bounds) - 1
    idx = torch.arange(batch, dtype=torch.int32)
    ranks = torch.full((batch,), rank, dtype=torch.int32)
    a, bt, sa, sb = [], [], [], []
    for _ in range(LAYERS):
        ai, si = _stack(fmt, (batch, nseg * rank, k), g)
        bi, ti = _stack(fmt, (batch, rank, n), g)
        if fmt == "int8":  # per rank row and segment, for both (lora_quant.py)
            si, ti = torch.rand(batch, nseg * rank, generator=g), torch.rand(batch, nseg * rank, generator=g)
        a.append(ai), bt.append(bi), sa.append(si), sb.append(ti)
    base = [PackedLinear(torch.randn(n, k, generator=g).to(torch.bfloat16)) for _ in range(LAYERS)]
    x = torch.randn(batch, k, generator=g).to(torch.bfloat16)
    y = torch.zeros(batch, n, dtype=torch.bfloat16)
    empty = torch.zeros(nseg + 1, dtype=torch.int32)
    full = torch.tensor(bounds, dtype=torch.int32)

    def lora(bounds_t: torch.Tensor, width: int, cols: int = k) -> None:
        for i in range(LAYERS):
            rc = lib.pdserve_lora(x.data_ptr(), k, y.data_ptr(), n, batch, cols, width, a[i].data_ptr(),
                                  bt[i].data_ptr(), rank, nseg, bounds_t.data_ptr(), idx.data_ptr(), ranks.data_ptr(),
                                  CODES[fmt], None if sa[i] is None else sa[i].data_ptr(),
                                  None if sb[i] is None else sb[i].data_ptr())
            assert rc == 0, rc

    def base_pass() -> None:
        for lin in base:
            lin(x)

    base_s = _timed(base_pass, rounds, clock)
    lora_s = _timed(lambda: lora(full, n), rounds, clock)
    shrink_s = _timed(lambda: lora(empty, 0), rounds, clock)
    expand_s = _timed(lambda: lora(full, n, 32), rounds, clock)
    per = bytes_per_weight(fmt) if fmt != "int4" else 0.5
    base_bytes = LAYERS * n * k * 2
    a_bytes, b_bytes = round(LAYERS * batch * nseg * rank * k * per), round(LAYERS * batch * rank * n * per)
    cpu_over_wall = None
    if clock is not time.thread_time:  # several threads: how many worked on the LoRA pass
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(rounds):
            lora(full, n)
        cpu_over_wall = round((time.process_time() - c0) / (time.perf_counter() - w0), 2)
    return {"base_ms": round(base_s * 1e3, 3), "lora_ms": round(lora_s * 1e3, 3),
            "shrink_ms": round(shrink_s * 1e3, 3), "expand_ms": round(expand_s * 1e3, 3),
            "base_mb": round(base_bytes / 1e6, 2), "lora_a_mb": round(a_bytes / 1e6, 2),
            "lora_b_mb": round(b_bytes / 1e6, 2),
            "base_gb_s": round(base_bytes / base_s / 1e9, 2), "lora_gb_s": round((a_bytes + b_bytes) / lora_s / 1e9, 2),
            "shrink_gb_s": round(a_bytes / shrink_s / 1e9, 2), "expand_gb_s": round(b_bytes / expand_s / 1e9, 2),
            "lora_cpu_over_wall": cpu_over_wall, "_bytes": (base_bytes, a_bytes + b_bytes)}


def main() -> None:
    rank, batch, threads, rounds = (int(a) for a in (sys.argv[1:5] + ["64", "8", "1", "5"][len(sys.argv) - 1:])[:4])
    fmt = sys.argv[5] if len(sys.argv) > 5 else "bf16"
    skip_engine = len(sys.argv) > 6 and sys.argv[6] == "kernels"
    torch.set_num_threads(threads)
    lib = native.library()
    clock = time.thread_time if threads == 1 else time.perf_counter
    g = torch.Generator().manual_seed(0)
    out: dict = {"rank": rank, "batch": batch, "threads": threads, "lora_dtype": fmt, "clock": clock.__name__,
                 "layers": LAYERS, "projections": {}}
    total = {"base_ms": 0.0, "lora_ms": 0.0, "shrink_ms": 0.0, "base_bytes": 0, "lora_bytes": 0}
    for proj, (k, bounds) in SHAPES.items():
        entry = _projection(lib, k, bounds, rank, batch, rounds, clock, g, fmt)
        base_bytes, lora_bytes = entry.pop("_bytes")
        out["projections"][proj] = entry
        for key in ("base_ms", "lora_ms", "shrink_ms"):
            total[key] += entry[key]
        total["base_bytes"] += base_bytes
        total["lora_bytes"] += lora_bytes
    buf = torch.randn(total["lora_bytes"] // 4, generator=g)
    ceiling_s = _timed(lambda: buf.sum(), rounds, clock)
    out["total"] = {key: round(v, 3) for key, v in total.items() if key.endswith("_ms")}
    out["total"]["lora_over_base_bytes"] = round(total["lora_bytes"] / total["base_bytes"], 3)
    out["total"]["base_gb_s"] = round(total["base_bytes"] / total["base_ms"] / 1e6, 2)
    out["total"]["lora_gb_s"] = round(total["lora_bytes"] / total["lora_ms"] / 1e6, 2)
    out["ceiling_read_gb_s"] = round(buf.numel() * 4 / ceiling_s / 1e9, 2)
    # the step's ratio if the rest of the step (attention, norms, logits) cost nothing: an upper bound
    out["total"]["layers_ratio"] = round(total["base_ms"] / (total["base_ms"] + total["lora_ms"]), 3)
    out["engine"] = None if skip_engine else _engine(rank, batch)
    print(json.dumps(out, indent=1))


def _engine(rank: int, batch: int) -> dict:
    import tempfile
    from pathlib import Path

    from services.config import EngineConfig
    from services.engine.engine import Engine
    from services.engine.lora_bench import PROMPT, _batch, write_random_adapter

    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(EngineConfig(dtype="bf16", max_num_seqs=batch, kv_cache_bytes=1 << 28, max_loras=batch,
                                     max_lora_rank=max(8, 1 << (rank - 1).bit_length())))
        names = [f"a{i}" for i in range(batch)]
        for i, name in enumerate(names):
            engine.register_lora(name, str(write_random_adapter(engine.model_config, Path(tmp) / name, rank, i)))
        prompts = [engine.tokenizer.encode(PROMPT.format(i=i)) for i in range(batch)]

        def cpu_ms(loras) -> float:
            _, cpu, tokens, _ = _batch(engine, prompts, loras, 32)
            return cpu / tokens * 1e3

        runs: dict[str, list[float]] = {"adapters": [], "none": [], "ranks_zeroed": []}
        with torch.inference_mode():
            cpu_ms(names), cpu_ms([None] * batch)
            for _ in range(3):
                runs["adapters"].append(cpu_ms(names))
                runs["none"].append(cpu_ms([None] * batch))
                saved = engine.loras.ranks.clone()
                engine.loras.ranks.zero_()
                runs["ranks_zeroed"].append(cpu_ms(names))
                engine.loras.ranks.copy_(saved)
    out = {f"{arm}_cpu_ms_per_token": round(_median(v), 3) for arm, v in runs.items()}
    out["lora_kernel_cpu_ms_per_token"] = round(out["adapters_cpu_ms_per_token"] - out["ranks_zeroed_cpu_ms_per_token"], 3)
    out["cpu_ratio"] = round(out["none_cpu_ms_per_token"] / out["adapters_cpu_ms_per_token"], 3)
    return out


if __name__ == "__main__":
    main()
