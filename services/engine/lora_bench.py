"""``pdserve bench lora``: what serving many LoRA adapters in one batch costs.

One engine per rank and ``--lora-dtype`` (the default model, bf16 unless told; the adapter store
in that format: bf16 exact, int8 or int4 quantized at load, kernels/lora_quant.py) with as many
random adapters in PEFT's format as the largest ``--batch`` (every projection: q/k/v/o,
gate/up/down; written by this bench, one directory each) held in as many slots. For each batch
size the same batch of prompts runs, alternating in ``--rounds`` rounds so drift cancels:

- ``none``: every request on the base model;
- ``adapters:<dtype>``: every request its own adapter, held in that format (the gathered kernel
  reads B adapters per step);
- ``none_unfused`` (a probe): the base model with the fused C decode driver off, which is the
  Python layer loop a LoRA step takes; it splits the gap into the LoRA matmuls and that path.

Per arm: the end-to-end throughput of the batch (generated tokens over the wall time from the
first add to the last token, prefill included), the same tokens over the stepping thread's CPU
time (``cpu_tok_per_s``: with ``--threads 1`` every kernel runs on that thread, so it is the work
the batch costs and stays meaningful on a busy machine where wall time does not) and the p50
time of a decode step in which every request decodes. The ratio adapters / none per lora dtype
is the figure (goal: at least 0.7x). Per ``--ranks`` and ``--batch`` size.

Accuracy beside the speed (``--accuracy-prompts``, services/engine/lora_accuracy.py): per rank
and lora dtype, adapter 0 on each prompt alone against PEFT's merged fp32 model in HF
transformers (first greedy divergence, max |logit| difference, per-token log-prob difference),
and the base model against HF's (``none``: the engine dtype's own distance, the floor).

Why the ratio falls with rank and batch: every request reads its own adapter's A and B once a
step (two flops a weight), so a step's adapter bytes grow as batch x rank while the base
weights are read once whatever the batch; on a CPU both are bound by memory. The result
carries the adapter bytes a step reads per lora dtype and their ratio to the base's.
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
from kernels.lora_quant import FORMATS, bytes_per_weight
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


def compare(engines: dict, names: list[str], prompts: list[list[int]], rounds: int, max_tokens: int) -> dict:
    """The arms alternating in each round: ``engines`` lora dtype -> engine (the first also runs the
    base arms)."""
    first = next(iter(engines.values()))
    arms = {"none": (first, [None] * len(prompts)), **{f"adapters:{d}": (e, names) for d, e in engines.items()}}
    if first.config.device == "cpu":  # the fused C decode driver is the CPU's
        arms["none_unfused"] = (first, [None] * len(prompts))
    wall = {a: 0.0 for a in arms}
    cpu = {a: 0.0 for a in arms}
    tokens = {a: 0 for a in arms}
    steps: dict[str, list[float]] = {a: [] for a in arms}
    fused = first.model._decode_layers
    for _ in range(rounds):
        for arm, (engine, loras) in arms.items():
            if arm == "none_unfused":
                engine.model._decode_layers = lambda kv_cache: None
            try:
                w, c, n, s = _batch(engine, prompts, loras, max_tokens)
            finally:
                first.model._decode_layers = fused
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
    none = out["none"]
    out["by_lora_dtype"] = {d: {"throughput_ratio": round(out[f"adapters:{d}"]["tok_per_s"] / none["tok_per_s"], 3),
                                "cpu_throughput_ratio": round(out[f"adapters:{d}"]["cpu_tok_per_s"]
                                                              / none["cpu_tok_per_s"], 3),
                                "decode_step_ratio": round(none["decode_step_ms_p50"]
                                                           / out[f"adapters:{d}"]["decode_step_ms_p50"], 3)}
                            for d in engines}
    if "none_unfused" in out:
        out["unfused_throughput_ratio"] = round(out["none_unfused"]["tok_per_s"] / none["tok_per_s"], 3)
    return out


def projection_bytes(cfg, rank: int, lora_dtype: str = "bf16") -> tuple[int, int]:
    """(one adapter's A and B at ``rank`` held in ``lora_dtype``, the base layers' bf16 projection
    weights), bytes over every layer: what a step reads per distinct adapter and once for the base."""
    q, kv, h, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, \
        cfg.intermediate_size
    shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]  # (in, out) of q k v o gate up down
    adapter = round(sum(rank * (k + n) for k, n in shapes) * cfg.num_layers * bytes_per_weight(lora_dtype))
    base = sum(k * n for k, n in shapes) * cfg.num_layers * 2
    return adapter, base


def run(args: argparse.Namespace) -> int:
    from services.engine.engine import Engine
    from services.engine.model_source import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    most = max(args.batch)
    result: dict = {"batches": args.batch, "rounds": args.rounds, "max_tokens": args.max_tokens, "goal": 0.7,
                    "lora_dtypes": args.lora_dtype, "cases": [], "accuracy": []}
    with tempfile.TemporaryDirectory(prefix="pdserve-lora-bench-") as tmp:
        model_config = resolve_model(args.model).config
        for rank in args.ranks:
            # the adapters given at start, as `--lora` gives them: on a GPU their steps get CUDA graphs too
            names = [f"bench-r{rank}-{i}" for i in range(most)]
            paths = [write_random_adapter(model_config, Path(tmp) / name, rank, i) for i, name in enumerate(names)]
            engines = {d: Engine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                              max_num_seqs=most, kv_cache_bytes=int(args.kv_cache_gb * 2**30),
                                              max_loras=most, loras={n: str(p) for n, p in zip(names, paths)},
                                              max_lora_rank=max(8, 1 << (rank - 1).bit_length()), lora_dtype=d))
                       for d in args.lora_dtype}
            first = next(iter(engines.values()))
            tok = first.tokenizer
            prompts = [tok.encode(PROMPT.format(i=i)) if tok else list(range(10 + i, 40 + i)) for i in range(most)]
            base_bytes = projection_bytes(first.model_config, rank)[1]
            result["model"], result["dtype"] = first.model_name, first.config.dtype
            result["threads"] = torch.get_num_threads()
            result["device"] = (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
                                else "cpu")
            if args.accuracy_prompts:
                result["accuracy"] += _accuracy(engines, names[0], paths[0], prompts[:args.accuracy_prompts], rank,
                                                args.max_tokens)
            for batch in args.batch:
                _log(f"{first.model_name}, {first.describe()}, {torch.get_num_threads()} threads, rank {rank}, "
                     f"batch {batch}, lora dtypes {','.join(engines)}")
                with torch.inference_mode():
                    for engine in engines.values():
                        _batch(engine, prompts[:batch], names[:batch], 4)  # warm-up: every adapter into its slot
                    _batch(first, prompts[:batch], [None] * batch, 4)
                    case = {"rank": rank, "batch": batch,
                            **compare(engines, names[:batch], prompts[:batch], args.rounds, args.max_tokens)}
                for d, by in case["by_lora_dtype"].items():
                    adapter_bytes = projection_bytes(first.model_config, rank, d)[0]
                    by["adapter_bytes_per_step"] = batch * adapter_bytes
                    by["adapter_over_base_bytes"] = round(batch * adapter_bytes / base_bytes, 3)
                case["base_bytes_per_step"] = base_bytes
                result["cases"].append(case)
                ratios = ", ".join(f"{d} {by['throughput_ratio']}x (CPU {by['cpu_throughput_ratio']}x)"
                                   for d, by in case["by_lora_dtype"].items())
                _log(f"rank {rank} batch {batch}: none {case['none']['tok_per_s']} tok/s; adapters/none {ratios}"
                     + (f"; unfused base {case['unfused_throughput_ratio']}x" if "unfused_throughput_ratio" in case
                        else ""))
            del engines, first
    result_files.report("lora", result, args, _table)
    return 0


def _accuracy(engines: dict, name: str, path: Path, prompts: list[list[int]], rank: int, max_tokens: int) -> list:
    """Adapter ``name`` under each lora dtype, and the base model, against HF (services/engine/lora_accuracy.py)."""
    from services.engine import lora_accuracy
    from services.engine.hf_baseline import hf_twin

    first = next(iter(engines.values()))
    hf, hf_base = lora_accuracy.peft_merged(first.model, path), hf_twin(first.model).float()
    rows = []
    with torch.inference_mode():
        row = lora_accuracy.compare(first, None, hf_base, hf_base, prompts, max_tokens)
        rows.append({"rank": rank, "lora_dtype": "none", **row})
        for d, engine in engines.items():
            rows.append({"rank": rank, "lora_dtype": d,
                         **lora_accuracy.compare(engine, name, hf, hf_base, prompts, max_tokens)})
    for r in rows:
        _log(f"accuracy rank {rank} {r['lora_dtype']}: first divergence {r['first_divergence']}, max |logit| diff "
             f"{r['max_abs_logit_diff']}, log-prob diff max {r['logprob_diff_max']} mean {r['logprob_diff_mean']} "
             f"(the adapter moves logits by up to {r['adapter_shift_max_logit']})")
    return rows


def _table(result: dict) -> None:
    print(f"every request its own adapter vs none ({result['model']}, {result['dtype']}, {result['threads']} threads)")
    print(f"{'rank':>5}{'batch':>6}{'lora':>6}{'none tok/s':>12}{'adapters':>10}{'ratio':>7}{'cpu ratio':>10}"
          f"{'step ms none':>14}{'adapters':>10}{'bytes a/b':>10}")
    for c in result["cases"]:
        for d, by in c["by_lora_dtype"].items():
            arm = c[f"adapters:{d}"]
            print(f"{c['rank']:>5}{c['batch']:>6}{d:>6}{c['none']['tok_per_s']:>12.1f}{arm['tok_per_s']:>10.1f}"
                  f"{by['throughput_ratio']:>7.2f}{by['cpu_throughput_ratio']:>10.2f}"
                  f"{c['none']['decode_step_ms_p50']:>14.2f}{arm['decode_step_ms_p50']:>10.2f}"
                  f"{by['adapter_over_base_bytes']:>10.2f}")
    if result["accuracy"]:
        print("against PEFT's merged fp32 model (none: the base model against HF's)")
        print(f"{'rank':>5}{'lora':>6}{'max |dlogit|':>14}{'dlogprob max':>14}{'mean':>9}{'first divergence':>20}")
        for r in result["accuracy"]:
            print(f"{r['rank']:>5}{r['lora_dtype']:>6}{r['max_abs_logit_diff']:>14.4f}{r['logprob_diff_max']:>14.4f}"
                  f"{r['logprob_diff_mean']:>9.5f}  {r['first_divergence']}")


def _lora_dtypes(value: str) -> list[str]:
    dtypes = [v.strip() for v in value.split(",") if v.strip()]
    bad = [d for d in dtypes if d not in FORMATS]
    if not dtypes or bad or len(set(dtypes)) != len(dtypes):
        raise argparse.ArgumentTypeError(f"--lora-dtype takes distinct {', '.join(FORMATS)}, comma-separated; "
                                         f"got {value!r}")
    return dtypes


def add_parser(sub) -> None:
    p = sub.add_parser("lora", help="multi-LoRA: a batch of distinct adapters against the same batch without",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--device", default="cpu",
                   help="cpu (default: the C kernels) or cuda[:N] (the Triton kernels; bf16 and int8 adapters)")
    p.add_argument("--batch", type=counts, default=[8],
                   help="batch sizes, comma-separated: requests, each with its own adapter (default 8)")
    p.add_argument("--ranks", type=counts, default=[16], help="adapter ranks, comma-separated (default 16)")
    p.add_argument("--rounds", type=at_least_one, default=3, help="alternating rounds per arm")
    p.add_argument("--max-tokens", type=at_least_one, default=64, help="tokens per request")
    p.add_argument("--kv-cache-gb", type=float, default=0.25)
    p.add_argument("--threads", type=at_least_one, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--lora-dtype", type=_lora_dtypes, default=["bf16"],
                   help="adapter store formats to compare, comma-separated: bf16 (exact), int8, int4 (default bf16)")
    p.add_argument("--accuracy-prompts", type=int, default=4,
                   help="prompts compared against PEFT's merged model per rank and lora dtype (0: skip; needs "
                        "peft and transformers)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
