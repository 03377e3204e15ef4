"""A worker's cold start on a GPU, measured: launch to first token with the weights read from local disk.

The simulator's GPU profiles carry a cold start (``cold_start_s`` in services/sim/calibration.json) that no
lent device had measured: 120 s, a parameter. This probe measures what pdserve's own engine takes to start on
the device it runs on, for a model of the profile's shape (default Llama-3.1-8B, bf16, random weights written
once as a Hugging Face checkpoint of safetensors shards, as a served checkpoint would be):

    python benchmarks/probes/gpu_cold_start.py DIR [--preset llama-3.1-8b] [--device cuda] [--runs 3]
        [--cold-runs 1] [--json F]

Each run is a fresh process (``python -c`` of this file's ``start``), timed from just before it is launched:
interpreter and imports, ``Engine(...)`` (the weights read from DIR onto the device, the KV cache, CUDA-graph
capture), then one request of 16 prompt tokens to its 8th output token. The first ``--cold-runs`` runs each
follow a drop of the page cache (``/proc/sys/vm/drop_caches``, where writable: a cold disk; the JSON says
whether it was), the others find the checkpoint in memory. What a real deployment adds is not here: pulling the image, fetching
the weights over a network, and registering with the router (under a second on the CPU machine:
``pdserve bench startup``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def write_checkpoint(directory: Path, preset: str, device: str, shard_bytes: float = 4e9) -> float:
    """Random bf16 weights of ``preset``'s shapes as HF safetensors shards + config.json; returns seconds."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from services.engine.hf_baseline import hf_config
    from services.engine.model_config import preset_config

    if (directory / "config.json").is_file():
        return 0.0
    t0 = time.perf_counter()
    config = hf_config(preset_config(preset))  # the transformers config the engine reads back as the preset
    with torch.device("meta"):  # the checkpoint's tensor names and shapes, no memory
        shapes = [(name, p.shape) for name, p in AutoModelForCausalLM.from_config(config).named_parameters()]
    tmp = directory.with_name(directory.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(0)
    shard, size, index = {}, 0, 0

    def flush():
        nonlocal shard, size, index
        if shard:
            index += 1
            save_file(shard, str(tmp / f"model-{index:05d}.safetensors"), metadata={"format": "pt"})
            print(f"[cold-start] wrote shard {index} ({size / 1e9:.1f} GB)", file=sys.stderr, flush=True)
        shard, size = {}, 0

    for name, shape in shapes:
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()
        shard[name] = t
        size += t.numel() * 2
        if size >= shard_bytes:
            flush()
    flush()
    config.save_pretrained(tmp)
    os.sync()
    tmp.rename(directory)
    return time.perf_counter() - t0


def start(directory: str, device: str, launched: float) -> None:
    """One cold start in this (fresh) process; prints a JSON line of its phases (seconds from launch)."""
    entered = time.time()
    import torch

    from services.config import EngineConfig
    from services.engine.engine import Engine
    from services.engine.sampling_params import SamplingParams

    imported = time.time()
    engine = Engine(EngineConfig(model=directory, device=device))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    ready = time.time()
    engine.add_request("first", list(range(100, 116)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    with torch.inference_mode():
        while engine.has_unfinished():
            engine.step()
    done = time.time()
    print(json.dumps({"interpreter_s": round(entered - launched, 3), "imports_s": round(imported - entered, 3),
                      "engine_s": round(ready - imported, 3), "first_request_s": round(done - ready, 3),
                      "launch_to_ready_s": round(ready - launched, 3),
                      "launch_to_first_request_done_s": round(done - launched, 3),
                      "cuda_graphs": engine.runner.cuda_graphs is not None}))


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="the checkpoint's directory (written there first if it has no config.json)")
    ap.add_argument("--preset", default="llama-3.1-8b", help="the shapes (services/engine/model_config.py PRESETS)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--runs", type=int, default=3, help="fresh processes to start, one after another")
    ap.add_argument("--cold-runs", type=int, default=1, help="how many of them (the first) follow a page-cache drop")
    ap.add_argument("--json", type=Path, help="write the whole result here")
    args = ap.parse_args()
    if args.runs < 1 or not 0 <= args.cold_runs <= args.runs:
        ap.error("--runs must be at least 1 and --cold-runs between 0 and --runs")
    write_s = write_checkpoint(args.dir, args.preset, args.device)
    gb = sum(f.stat().st_size for f in args.dir.glob("*.safetensors")) / 1e9
    print(f"[cold-start] checkpoint {gb:.2f} GB ({'written in %.1f s' % write_s if write_s else 'already there'})",
          file=sys.stderr)
    runs = []
    for i in range(args.runs):
        dropped = drop_page_cache() if i < args.cold_runs else False
        code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                f"import gpu_cold_start as g; g.start({str(args.dir)!r}, {args.device!r}, {time.time()!r})")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        run = json.loads(proc.stdout.strip().splitlines()[-1]) | {"page_cache_dropped": dropped}
        runs.append(run)
        print(f"[cold-start] run {i + 1}: " + ", ".join(f"{k} {v}" for k, v in run.items()), file=sys.stderr)
    out = {"preset": args.preset, "device": args.device, "checkpoint_gb": round(gb, 3), "write_s": round(write_s, 1),
           "runs": runs}
    if args.device.startswith("cuda"):
        import torch

        out["gpu"] = torch.cuda.get_device_name(args.device)
        out["torch"] = torch.__version__
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
