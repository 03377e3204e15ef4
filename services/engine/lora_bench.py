"""``pdserve bench lora``: what serving many LoRA adapters in one batch costs.

One engine per rank (the default model, bf16 unless told) with as many random adapters in
PEFT's format as the largest ``--batch`` (every projection: q/k/v/o, gate/up/down; written by
this bench, one directory each) held in as many slots. For each batch size the same batch of
prompts runs, alternating in ``--rounds`` rounds so drift cancels:

- ``none``: every request on the base model;
- ``adapters``: every request its own adapter (the gathered kernel reads B adapters per step);
- ``none_unfused`` (a probe): the base model with the fused C decode driver off, which is the
  Python layer loop a LoRA step takes; it splits the gap into the LoRA matmuls and that path.

Per arm: the end-to-end throughput of the batch (generated tokens over the wall time from the
first add to the last token, prefill included), the same tokens over the stepping thread's CPU
time (``cpu_tok_per_s``: with ``--threads 1`` every kernel runs on that thread, so it is the work
the batch costs and stays meaningful on a busy machine where wall time does not) and the p50
time of a decode step in which every request decodes. The ratio adapters / none is the figure
(goal: at least 0.7x). Per ``--ranks`` and ``--batch`` size.

Why the ratio falls with rank and batch: every request reads its own adapter's A and B once a
step (two flops a weight), so a step's adapter bytes grow as batch x rank while the base
weights are read once whatever the batch; on a CPU both are bound by memory. The result
carries both byte counts (``adapter_over_base_bytes``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from services.bench import results as result_files
from services.bench.args import at_least_one, counts
from services.bench.stats import percentile
from services.config import EngineConfig
from services.engine.lora_config import CONFIG_FILE, MODULES, WEIGHTS_FILE
from services.engine.sampling_params import SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. Story {i}:"


def _log(msg: str) -> None:
    print(f"[bench lora] {msg}", file=sys.stderr, flush=True)


def write_random_adapter(cfg, directory: Path, rank: int, seed: int, b_std: float = 0.01) -> Path:
    """A PEFT-format adapter on every projection of ``cfg``'s shapes: random A (unit-variance outputs) and B
    (standard deviation ``b_std``; larger changes the model's answers more)."""
    from safetensors.torch import save_file

    q, kv, h, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, \
        cfg.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module, (fan_in, fan_out) in shapes.items():
            kind = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * fan_in ** -0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * b_std
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / WEIGHTS_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(MODULES),
        "bias": "none", "lora_dropout": 0.0}))
    return directory


def _batch(engine, prompts: list[list[int]], loras: list[str | None], max_tokens: int) -> tuple[float, float, int, list]:
    """(wall seconds, this thread's CPU seconds, generated tokens, decode step seconds) of the batch
    run to the end."""
    ids = [f"l{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    t0, c0 = time.perf_counter(), time.thread_time()
    for rid, prompt, lora in zip(ids, prompts, loras):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                                       lora=lora))
    tokens, steps = 0, []
    while engine.has_unfinished():
        full = len(engine.requests) == len(ids) and all(r.num_output_tokens >= 1 for r in engine.requests.values())
        s0 = time.perf_counter()
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        if full:
            steps.append(time.perf_counter() - s0)
    return time.perf_counter() - t0, time.thread_time() - c0, tokens, steps


def compare(engine, names: list[str], prompts: list[list[int]], rounds: int, max_tokens: int) -> dict:
    arms = {"none": [None] * len(prompts), "adapters": names, "none_unfused": [None] * len(prompts)}
    wall = {a: 0.0 for a in arms}
    cpu = {a: 0.0 for a in arms}
    tokens = {a: 0 for a in arms}
    steps: dict[str, list[float]] = {a: [] for a in arms}
    fused = engine.model._decode_layers
    for _ in range(rounds):
        for arm, loras in arms.items():
            if arm == "none_unfused":
                engine.model._decode_layers = lambda kv_cache: None
            try:
                w, c, n, s = _batch(engine, prompts, loras, max_tokens)
            finally:
                engine.model._decode_layers = fused
            wall[arm] += w
            cpu[arm] += c
            tokens[arm] += n
            steps[arm] += s
    out = {}
    for arm in arms:
        out[arm] = {"tok_per_s": round(tokens[arm] / wall[arm], 2), "cpu_tok_per_s": round(tokens[arm] / cpu[arm], 2),
                    "tokens": tokens[arm],
                    "decode_step_ms_p50": round(percentile([s * 1e3 for s in steps[arm]], 50), 3),
                    "decode_steps": len(steps[arm])}
    out["throughput_ratio"] = round(out["adapters"]["tok_per_s"] / out["none"]["tok_per_s"], 3)
    out["cpu_throughput_ratio"] = round(out["adapters"]["cpu_tok_per_s"] / out["none"]["cpu_tok_per_s"], 3)
    out["decode_step_ratio"] = round(out["none"]["decode_step_ms_p50"] / out["adapters"]["decode_step_ms_p50"], 3)
    out["unfused_throughput_ratio"] = round(out["none_unfused"]["tok_per_s"] / out["none"]["tok_per_s"], 3)
    return out


def projection_bytes(cfg, rank: int) -> tuple[int, int]:
    """(one adapter's A and B at ``rank``, the base layers' projection weights), bf16 bytes over
    every layer: what a step reads per distinct adapter and once for the base."""
    q, kv, h, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, \
        cfg.intermediate_size
    shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]  # (in, out) of q k v o gate up down
    adapter = sum(rank * (k + n) for k, n in shapes) * cfg.num_layers * 2
    base = sum(k * n for k, n in shapes) * cfg.num_layers * 2
    return adapter, base


def run(args: argparse.Namespace) -> int:
    from services.engine.engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    most = max(args.batch)
    result: dict = {"batches": args.batch, "rounds": args.rounds, "max_tokens": args.max_tokens, "goal": 0.7,
                    "cases": []}
    with tempfile.TemporaryDirectory(prefix="pdserve-lora-bench-") as tmp:
        for rank in args.ranks:
            engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=most,
                                         kv_cache_bytes=int(args.kv_cache_gb * 2**30), max_loras=most,
                                         max_lora_rank=max(8, 1 << (rank - 1).bit_length())))
            names = []
            for i in range(most):
                name = f"bench-r{rank}-{i}"
                engine.register_lora(name, str(write_random_adapter(engine.model_config, Path(tmp) / name, rank, i)))
                names.append(name)
            tok = engine.tokenizer
            prompts = [tok.encode(PROMPT.format(i=i)) if tok else list(range(10 + i, 40 + i)) for i in range(most)]
            adapter_bytes, base_bytes = projection_bytes(engine.model_config, rank)
            result["model"], result["dtype"] = engine.model_name, engine.config.dtype
            result["threads"] = torch.get_num_threads()
            for batch in args.batch:
                _log(f"{engine.model_name}, {engine.describe()}, {torch.get_num_threads()} threads, rank {rank}, "
                     f"batch {batch}")
                with torch.inference_mode():
                    _batch(engine, prompts[:batch], names[:batch], 4)  # warm-up: every adapter into its slot
                    _batch(engine, prompts[:batch], [None] * batch, 4)
                    case = {"rank": rank, "batch": batch,
                            **compare(engine, names[:batch], prompts[:batch], args.rounds, args.max_tokens)}
                case["adapter_over_base_bytes"] = round(batch * adapter_bytes / base_bytes, 3)
                result["cases"].append(case)
                _log(f"rank {rank} batch {batch}: none {case['none']['tok_per_s']} tok/s, adapters "
                     f"{case['adapters']['tok_per_s']} tok/s ({case['throughput_ratio']}x; CPU time "
                     f"{case['cpu_throughput_ratio']}x); decode step p50 {case['none']['decode_step_ms_p50']} / "
                     f"{case['adapters']['decode_step_ms_p50']} ms; unfused base {case['unfused_throughput_ratio']}x")
            del engine
    result_files.report("lora", result, args, _table)
    return 0


def _table(result: dict) -> None:
    print(f"every request its own adapter vs none ({result['model']}, {result['dtype']}, {result['threads']} threads)")
    print(f"{'rank':>5}{'batch':>6}{'none tok/s':>12}{'adapters':>10}{'ratio':>7}{'cpu ratio':>10}"
          f"{'step ms none':>14}{'adapters':>10}{'unfused base':>14}{'bytes a/b':>10}")
    for c in result["cases"]:
        print(f"{c['rank']:>5}{c['batch']:>6}{c['none']['tok_per_s']:>12.1f}{c['adapters']['tok_per_s']:>10.1f}"
              f"{c['throughput_ratio']:>7.2f}{c['cpu_throughput_ratio']:>10.2f}"
              f"{c['none']['decode_step_ms_p50']:>14.2f}{c['adapters']['decode_step_ms_p50']:>10.2f}"
              f"{c['unfused_throughput_ratio']:>13.2f}x{c['adapter_over_base_bytes']:>10.2f}")


def add_parser(sub) -> None:
    p = sub.add_parser("lora", help="multi-LoRA: a batch of distinct adapters against the same batch without",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--batch", type=counts, default=[8],
                   help="batch sizes, comma-separated: requests, each with its own adapter (default 8)")
    p.add_argument("--ranks", type=counts, default=[16], help="adapter ranks, comma-separated (default 16)")
    p.add_argument("--rounds", type=at_least_one, default=3, help="alternating rounds per arm")
    p.add_argument("--max-tokens", type=at_least_one, default=64, help="tokens per request")
    p.add_argument("--kv-cache-gb", type=float, default=0.25)
    p.add_argument("--threads", type=at_least_one, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
