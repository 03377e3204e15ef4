"""Probe: does a second thread read faster? The gathered LoRA kernel and a plain read at 1 and 2 threads.

    PYTHONPATH=. [nice -n -20] python benchmarks/probes/lora_threads.py [rank=64] [batch=8] [rounds=3] [lora_dtypes=bf16,int8,int4]

Why: with every request of a decode batch on its own adapter the LoRA calls are bound by the bytes
they read (benchmarks/probes/lora_rank.py); the engine runs 2 torch threads by default, and the C
kernel splits a step's rows over the same OpenMP pool (kernels/native.py: one libgomp), so the
question is whether two cores read a step's adapters faster than one. In one process, thread
counts alternating in each round so drift cancels: per lora dtype the kernel over SmolLM2-135M's
30 layers and four projections (``batch`` rows, each its own rank-``rank`` adapter, read from DRAM:
lora_rank.py's stacks), and a plain read (torch sum) of as many bytes. Wall time; on a
busy machine a thread waits for a core, so run it alone (``nice -n -20`` as root keeps other
processes off the cores). Prints one JSON object: medians per thread count, and 2-thread / 1-thread
speedups.
"""

from __future__ import annotations

import json
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from lora_rank import LAYERS, SHAPES, _flush, _median, _stack  # noqa: E402  (a probe beside this one)


def _passes(lib, fmt: str, rank: int, batch: int, g) -> tuple:
    """A callable running the LoRA kernel over every layer and projection (each row its own
    adapter, the stacks built once) and the adapter bytes it reads."""
    from kernels.lora_quant import CODES

    calls, nbytes = [], 0
    idx = torch.arange(batch, dtype=torch.int32)
    ranks = torch.full((batch,), rank, dtype=torch.int32)
    for k, bounds in SHAPES.values():
        n, nseg = bounds[-1], len(bounds) - 1
        x = torch.randn(batch, k, generator=g).to(torch.bfloat16)
        y = torch.zeros(batch, n, dtype=torch.bfloat16)
        bt_ = torch.tensor(bounds, dtype=torch.int32)
        for _ in range(LAYERS):
            a, sa = _stack(fmt, (batch, nseg * rank, k), g)
            bt, sb = _stack(fmt, (batch, rank, n), g)
            if fmt == "int8":
                sa, sb = torch.rand(batch, nseg * rank, generator=g), torch.rand(batch, nseg * rank, generator=g)
            nbytes += a.numel() * a.element_size() + bt.numel() * bt.element_size()
            calls.append((x, k, y, n, a, bt, nseg, bt_, sa, sb))

    def run() -> None:
        for x, k, y, n, a, bt, nseg, bt_, sa, sb in calls:
            rc = lib.pdserve_lora(x.data_ptr(), k, y.data_ptr(), n, batch, k, n, a.data_ptr(), bt.data_ptr(), rank,
                                  nseg, bt_.data_ptr(), idx.data_ptr(), ranks.data_ptr(), CODES[fmt],
                                  None if sa is None else sa.data_ptr(), None if sb is None else sb.data_ptr())
            assert rc == 0, rc
    return run, nbytes


def _wall(fn) -> float:
    _flush()  # from DRAM, as a step reads them
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    args = sys.argv[1:] + [None] * 4
    rank, batch, rounds = int(args[0] or 64), int(args[1] or 8), int(args[2] or 3)
    dtypes = (args[3] or "bf16,int8,int4").split(",")
    from kernels import native

    lib = native.library()
    g = torch.Generator().manual_seed(0)
    passes = {d: _passes(lib, d, rank, batch, g) for d in dtypes}
    buf = torch.randn(passes[dtypes[0]][1] // 4, generator=g)
    times: dict = {(d, t): [] for d in [*dtypes, "read"] for t in (1, 2)}
    for _ in range(rounds):
        for t in (1, 2):
            torch.set_num_threads(t)
            for d in dtypes:
                passes[d][0]()  # the OpenMP pool at this size, warm
                times[d, t].append(_wall(passes[d][0]))
            times["read", t].append(_wall(lambda: buf.sum()))
    out: dict = {"rank": rank, "batch": batch, "rounds": rounds, "layers": LAYERS, "clock": "perf_counter (wall)",
                 "lora": {}}
    for d in dtypes:
        ms = {t: _median(times[d, t]) * 1e3 for t in (1, 2)}
        out["lora"][d] = {"bytes": passes[d][1], "ms_1_thread": round(ms[1], 3), "ms_2_threads": round(ms[2], 3),
                          "gb_s_1_thread": round(passes[d][1] / ms[1] / 1e6, 2),
                          "gb_s_2_threads": round(passes[d][1] / ms[2] / 1e6, 2),
                          "speedup_2_over_1": round(ms[1] / ms[2], 3)}
    read = {t: buf.numel() * 4 / _median(times["read", t]) / 1e9 for t in (1, 2)}
    out["read"] = {"bytes": buf.numel() * 4, "gb_s_1_thread": round(read[1], 2), "gb_s_2_threads": round(read[2], 2),
                   "speedup_2_over_1": round(read[2] / read[1], 3)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
