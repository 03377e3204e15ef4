"""Probe: a change to kernels/lora_cpu.c against a git revision's, paired in one process.

    PYTHONPATH=. python benchmarks/probes/lora_variants.py [base_rev=HEAD] [lora_dtype=int4] [rounds=15] [rank=64] [batch=8] [dram|cached]

Why: on this shared machine one kernel's time moves by 5-10% between runs a minute apart, more
than most changes to it; two runs of lora_rank.py cannot tell a 5% change from drift. This builds
the working tree's lora_cpu.c and ``base_rev``'s as two libraries (the avx512_vnni level's flags,
kernels/native.py), and times their passes alternately over the same stacks (lora_threads.py's
passes: SmolLM2-135M's 30 layers x 4 projections, ``batch`` rows each its own rank-``rank`` adapter),
each pass after a 1 GiB read (``dram``, as a step reads them) or not (``cached``: from the L3 the
previous pass warmed, the kernel's compute rate). One thread, thread CPU time. Prints one JSON
object: medians and min per variant, and new / base.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from lora_rank import _flush, _median  # noqa: E402  (probes beside this one)
from lora_threads import _passes  # noqa: E402

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def _build(source: str, out: Path) -> ctypes.CDLL:
    from kernels import cpu_isa, native

    src = out.with_suffix(".c")
    src.write_text(source)
    flags = native._FLAGS + cpu_isa.compiler_flags("avx512_vnni")
    subprocess.run([native._compiler(), *flags, f"-I{KERNELS}", "-shared", str(src), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    lib.pdserve_lora.restype = i32
    lib.pdserve_lora.argtypes = [p, i64, p, i64, i32, i32, i32, p, p, i32, i32, p, p, p, i32, p, p]
    return lib


def main() -> None:
    args = sys.argv[1:] + [None] * 6
    rev, fmt = args[0] or "HEAD", args[1] or "int4"
    rounds, rank, batch = int(args[2] or 15), int(args[3] or 64), int(args[4] or 8)
    dram = (args[5] or "dram") == "dram"
    torch.set_num_threads(1)
    base_src = subprocess.run(["git", "show", f"{rev}:kernels/lora_cpu.c"], check=True, capture_output=True,
                              text=True, cwd=KERNELS).stdout
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": _build(base_src, Path(tmp) / "base.so"),
                "new": _build((KERNELS / "lora_cpu.c").read_text(), Path(tmp) / "new.so")}
        runs = {}
        for name, lib in libs.items():
            g = torch.Generator().manual_seed(0)  # the same stacks for both
            runs[name] = _passes(lib, fmt, rank, batch, g)
        times: dict[str, list[float]] = {name: [] for name in libs}
        for name in libs:
            runs[name][0]()  # warm-up: page faults, first touches
        for _ in range(rounds):
            for name in libs:
                if dram:
                    _flush()
                t0 = time.thread_time()
                runs[name][0]()
                times[name].append(time.thread_time() - t0)
    nbytes = runs["new"][1]
    out = {"base_rev": rev, "lora_dtype": fmt, "rank": rank, "batch": batch, "rounds": rounds,
           "mode": "dram" if dram else "cached", "adapter_mb": round(nbytes / 1e6, 1)}
    for name, ts in times.items():
        out[name] = {"median_ms": round(_median(ts) * 1e3, 3), "min_ms": round(min(ts) * 1e3, 3),
                     "gb_s": round(nbytes / _median(ts) / 1e9, 2)}
    out["new_over_base"] = round(_median(times["new"]) / _median(times["base"]), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
