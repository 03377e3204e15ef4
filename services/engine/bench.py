"""``pdserve bench engine``: pdserve's engine against HF transformers and llama.cpp, at their
best, in one run.

Workload (seeded): N requests with random prompts of 32-512 tokens and target outputs of
16-256 tokens; every request produces exactly its target (EOS ignored on every side). Only
target tokens count as output.

- **throughput**: pdserve runs the whole workload under continuous batching. HF
  transformers ``generate`` runs it in length-bucketed static batches (sorted by prompt
  length, left-padded) for every ``--hf-dtypes`` x ``--hf-batch-sizes``; the fastest is the
  baseline (services/engine/bench_hf.py). llama.cpp (llama-cpp-python, if installed) runs it
  on the same GGUF with continuous batching in one context of ``--llamacpp-seqs`` slots.
  pdserve also runs it serving the GGUF file's own blocks (``--quantization gguf``).
- **decode**: batch-1 decode, one 64-token prompt, tokens/s after the first token: pdserve
  in ``--dtype`` and each ``--quantization``, HF in each dtype, llama.cpp.
- **quality**: perplexity on a fixed 4k-token text (services/engine/perplexity.py) of
  pdserve in ``--dtype`` and each ``--quantization``.
- **kv**: the int8 KV cache (``--kv-cache-dtype int8``) against the ``--dtype`` one in the
  same memory: blocks, batch-1 decode after ``--kv-context`` tokens of the perplexity text,
  and (with quality) perplexity.

Ratios: ``throughput_ratio_vs_hf_best`` / ``decode_b1_ratio_vs_hf_best`` against HF's best
(dtype, batch size); ``throughput_ratio_vs_hf`` / ``decode_b1_ratio_vs_hf`` against HF in
pdserve's dtype; ``throughput_ratio_vs_llamacpp`` / ``decode_b1_ratio_vs_llamacpp``: pdserve
serving the GGUF's blocks against llama.cpp on the same file (``default_*_vs_llamacpp``: the
``--dtype`` path); ``int8_*_vs_bf16`` / ``gguf_*_vs_bf16`` / ``kv_int8_*``: quantized against
``--dtype``. The result names the CPU, the kernel level that ran and the load when it began.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from services.bench import results as result_files
from services.bench.args import at_least_one
from services.bench.stats import ratio
from services.config import EngineConfig
from services.engine.bench_hf import hf_best
from services.engine.sampling_params import SamplingParams

SECTIONS = ("throughput", "decode", "quality", "kv")


def make_workload(n: int, seed: int, vocab: int, max_output: int = 256) -> list[tuple[list[int], int]]:
    """``n`` (prompt, output length) pairs: prompts of 32-512 tokens, outputs of 16-256 capped at ``max_output``."""
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab - 100) for _ in range(rng.randint(32, 512))],
             min(rng.randint(16, 256), max_output)) for _ in range(n)]


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ---- pdserve ---------------------------------------------------------------
def pdserve_mixed(engine, workload) -> float:
    t = time.perf_counter()
    for i, (prompt, out_len) in enumerate(workload):
        engine.add_request(f"mix-{i}", prompt, SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True))
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    dt = time.perf_counter() - t
    assert produced == sum(o for _, o in workload), "pdserve produced a different number of tokens"
    return produced / dt


def pdserve_decode_b1(engine, prompt: list[int], n: int, rid: str = "b1") -> float:
    engine.add_request(rid, prompt, SamplingParams(max_tokens=n + 1, temperature=0, ignore_eos=True))
    while engine.requests[rid].num_output_tokens == 0:
        engine.step()
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return n / (time.perf_counter() - t)


def _engine(args, **overrides):
    from services.engine.engine import Engine

    config = dict(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    return Engine(EngineConfig(**{**config, **overrides}))


# ---- the run ---------------------------------------------------------------
def collect(args: argparse.Namespace) -> dict:
    from kernels import native
    from services.engine import bench_llamacpp
    from services.engine.model_source import default_model_path
    from services.engine.perplexity import TEXT_SOURCE, perplexity, text_tokens

    sections = set(args.sections)
    engine = _engine(args)
    if engine.source.weights_dir is None:
        raise ValueError("bench engine needs real weights for the HF baseline; dummy models are for bench gpu")
    vocab = engine.model_config.vocab_size
    workload = make_workload(args.requests, args.seed, vocab, args.max_output_tokens)
    warmup = make_workload(4, args.seed + 1, vocab, args.max_output_tokens)
    b1_prompt = workload[0][0][:64]
    pad_id = engine.eos_token_ids[0] if engine.eos_token_ids else 0
    machine = result_files.machine()
    result: dict = {
        "model": engine.model_name, "dtype": engine.config.dtype, "threads": torch.get_num_threads(),
        "cpu": machine["cpu_model"], "cpu_kernels": native.level(), "loadavg_1m_at_start": machine["loadavg_1m"],
        "requests": len(workload), "max_output_tokens": args.max_output_tokens,
        "prompt_tokens": sum(len(p) for p, _ in workload), "output_tokens": sum(o for _, o in workload)}
    _log(f"{engine.model_name}, {engine.describe()}, {torch.get_num_threads()} threads, {machine['cpu_model']}; "
         f"{len(workload)} requests, {result['prompt_tokens']} prompt / {result['output_tokens']} output tokens")
    llama = bench_llamacpp.available() and args.model is None and not args.no_llamacpp

    with torch.inference_mode():
        pdserve_mixed(engine, warmup)
        if "decode" in sections:
            _log("batch-1 decode: pdserve")
            result["pdserve_decode_b1_tok_s"] = round(pdserve_decode_b1(engine, b1_prompt, args.decode_tokens), 1)
        if "throughput" in sections:
            _log("mixed workload: pdserve")
            result["pdserve_tok_s"] = round(pdserve_mixed(engine, workload), 1)
        if "quality" in sections:
            ids = text_tokens(engine.tokenizer, args.ppl_tokens)
            _log(f"perplexity, {args.ppl_tokens} tokens: pdserve {engine.config.dtype}")
            result.update(ppl_text=TEXT_SOURCE, ppl_tokens=args.ppl_tokens, ppl=round(perplexity(engine, ids), 4))
        if "kv" in sections:
            context = text_tokens(engine.tokenizer, args.kv_context)[: args.kv_context]
            result.update(kv_context_tokens=len(context), kv_blocks=engine.block_pool.num_blocks,
                          kv_block_bytes=engine.kv_spec.block_bytes)
            _log(f"batch-1 decode after {len(context)} tokens of context: pdserve, {engine.kv_spec.dtype} KV")
            result["decode_long_tok_s"] = round(pdserve_decode_b1(engine, context, args.decode_tokens, "long"), 1)
        del engine
        for quant in args.quantization:
            if quant == "none" or (quant == "gguf" and args.model is not None):
                continue
            variant = _engine(args, quantization=quant)
            pdserve_mixed(variant, warmup[:2])
            if "decode" in sections:
                _log(f"batch-1 decode: pdserve {quant} weights")
                result[f"{quant}_decode_b1_tok_s"] = round(pdserve_decode_b1(variant, b1_prompt, args.decode_tokens), 1)
            if "throughput" in sections and quant == "gguf":  # beside llama.cpp on the same file
                _log(f"mixed workload: pdserve {quant} weights")
                result[f"{quant}_tok_s"] = round(pdserve_mixed(variant, workload), 1)
            if "quality" in sections:
                _log(f"perplexity: pdserve {quant} weights")
                result[f"{quant}_ppl"] = round(perplexity(variant, ids), 4)
            del variant
        if "kv" in sections:
            variant = _engine(args, kv_cache_dtype="int8")
            pdserve_mixed(variant, warmup[:2])
            result.update(kv_int8_blocks=variant.block_pool.num_blocks, kv_int8_block_bytes=variant.kv_spec.block_bytes)
            _log(f"batch-1 decode after {len(context)} tokens of context: pdserve, int8 KV")
            result["kv_int8_decode_long_tok_s"] = round(
                pdserve_decode_b1(variant, context, args.decode_tokens, "long"), 1)
            if "quality" in sections:
                _log("perplexity: pdserve, int8 KV")
                result["kv_int8_ppl"] = round(perplexity(variant, ids), 4)
            del variant

    if "throughput" in sections or "decode" in sections:
        hf = hf_best(engine_dir(args), workload if "throughput" in sections else [], warmup[:2], b1_prompt,
                     args.decode_tokens, args.hf_dtypes, args.hf_batch_sizes if "throughput" in sections else [],
                     pad_id)
        result["hf"] = hf
    if llama:
        result["llamacpp"] = llama_cpp_section(str(default_model_path()), workload, b1_prompt, args, sections)
    _ratios(result)
    return result


def engine_dir(args):
    from services.engine.model_source import resolve_model

    return resolve_model(args.model).weights_dir


def llama_cpp_section(gguf: str, workload, prompt, args, sections) -> dict:
    """llama.cpp's figures, each measured in a child process (bench_llamacpp.isolated): a
    llama-cpp-python build that crashes leaves ``error`` (why) instead of its figures."""
    from services.engine.bench_llamacpp import (
        isolated,
        measure_batched,
        measure_decode_b1,
        system_info,
    )

    threads = torch.get_num_threads()
    out: dict = {"runs": []}
    info, out["error"] = isolated(system_info)
    if info is not None:
        out["build"] = info
    if "decode" in sections and info is not None:
        _log("batch-1 decode: llama.cpp")
        tok_s, out["error"] = isolated(measure_decode_b1, gguf, threads, prompt, args.decode_tokens)
        if tok_s is not None:
            out["decode_b1_tok_s"] = round(tok_s, 1)
    if "throughput" in sections and out["error"] is None:
        for seqs in args.llamacpp_seqs:
            _log(f"mixed workload: llama.cpp, continuous batching over {seqs} sequence slots")
            tok_s, out["error"] = isolated(measure_batched, gguf, threads, seqs, args.max_num_batched_tokens, workload)
            if tok_s is None:
                break
            out["runs"].append({"max_seqs": seqs, "tok_s": round(tok_s, 1)})
            _log(f"  {out['runs'][-1]['tok_s']} tok/s")
        if out["runs"]:
            out["best"] = max(out["runs"], key=lambda r: r["tok_s"])
    if out["error"] is not None:
        _log(f"llama.cpp left out: {out['error']}")
    else:
        del out["error"]
    return out


def _ratios(r: dict) -> None:
    hf, lc = r.get("hf"), r.get("llamacpp", {})
    if hf:
        same = [run for run in hf["runs"] if run["dtype"] == r["dtype"]]
        r["hf_tok_s"] = max((run["tok_s"] for run in same), default=None)
        r["hf_best_tok_s"] = hf["best"]["tok_s"] if hf["best"] else None
        r["hf_decode_b1_tok_s"] = hf["decode_b1"].get(r["dtype"])
        r["hf_best_decode_b1_tok_s"] = hf["best_decode_b1"]["tok_s"]
        r["throughput_ratio_vs_hf"] = ratio(r.get("pdserve_tok_s"), r["hf_tok_s"], 2)
        r["throughput_ratio_vs_hf_best"] = ratio(r.get("pdserve_tok_s"), r["hf_best_tok_s"], 2)
        r["decode_b1_ratio_vs_hf"] = ratio(r.get("pdserve_decode_b1_tok_s"), r["hf_decode_b1_tok_s"], 2)
        r["decode_b1_ratio_vs_hf_best"] = ratio(r.get("pdserve_decode_b1_tok_s"), r["hf_best_decode_b1_tok_s"], 2)
    if lc.get("error"):
        r["llama_cpp_error"] = lc["error"]
    if lc:
        # the same file on both sides: pdserve serving its blocks (--quantization gguf); and
        # pdserve's default (--dtype) path beside it
        r["llamacpp_decode_b1_tok_s"] = lc.get("decode_b1_tok_s")
        r["llamacpp_tok_s"] = lc["best"]["tok_s"] if lc.get("best") else None
        r["decode_b1_ratio_vs_llamacpp"] = ratio(r.get("gguf_decode_b1_tok_s"), r["llamacpp_decode_b1_tok_s"], 2)
        r["throughput_ratio_vs_llamacpp"] = ratio(r.get("gguf_tok_s"), r["llamacpp_tok_s"], 2)
        r["default_decode_b1_ratio_vs_llamacpp"] = ratio(r.get("pdserve_decode_b1_tok_s"),
                                                         r["llamacpp_decode_b1_tok_s"], 2)
        r["default_throughput_ratio_vs_llamacpp"] = ratio(r.get("pdserve_tok_s"), r["llamacpp_tok_s"], 2)
    # the int8 KV cache against the --dtype one, in the same memory
    r["kv_int8_blocks_ratio"] = ratio(r.get("kv_int8_blocks"), r.get("kv_blocks"), 2)
    r["kv_int8_decode_long_ratio_vs_bf16"] = ratio(r.get("kv_int8_decode_long_tok_s"), r.get("decode_long_tok_s"), 2)
    r["kv_int8_ppl_ratio_vs_bf16"] = ratio(r.get("kv_int8_ppl"), r.get("ppl"), 4)
    for quant in ("int8", "gguf"):
        r[f"{quant}_decode_b1_ratio_vs_bf16"] = ratio(r.get(f"{quant}_decode_b1_tok_s"), r.get("pdserve_decode_b1_tok_s"), 2)
        r[f"{quant}_ppl_ratio_vs_bf16"] = ratio(r.get(f"{quant}_ppl"), r.get("ppl"), 4)
    for key in [k for k, v in r.items() if v is None]:
        del r[key]


def render(r: dict) -> str:
    lines = [f"pdserve bench engine | {r['model']} {r['dtype']} | {r['threads']} threads | {r['cpu']} | "
             f"CPU kernels: {r['cpu_kernels']}"]
    cols = (f"pdserve {r['dtype'][:4]}", "HF best", "vs HF best", "pdserve gguf", "llama.cpp", "vs llama.cpp")
    lines.append(f"{'':28}" + "".join(f"{c:>14}" for c in cols))
    rows = [("mixed workload, out tok/s", "pdserve_tok_s", "hf_best_tok_s", "throughput_ratio_vs_hf_best",
             "gguf_tok_s", "llamacpp_tok_s", "throughput_ratio_vs_llamacpp"),
            ("batch-1 decode, tok/s", "pdserve_decode_b1_tok_s", "hf_best_decode_b1_tok_s", "decode_b1_ratio_vs_hf_best",
             "gguf_decode_b1_tok_s", "llamacpp_decode_b1_tok_s", "decode_b1_ratio_vs_llamacpp")]
    for label, *keys in rows:
        cells = [(f"{r[k]:.2f}x" if "ratio" in k else f"{r[k]:.1f}") if k in r else "-" for k in keys]
        lines.append(f"{label:28}" + "".join(f"{c:>14}" for c in cells))
    if "hf" in r:
        runs = ", ".join(f"{x['dtype']} x{x['batch_size']}: {x['tok_s']}" for x in r["hf"]["runs"])
        b1 = ", ".join(f"{d}: {v}" for d, v in r["hf"]["decode_b1"].items())
        lines.append(f"HF runs (length-bucketed static batches), tok/s: {runs or '-'}; batch-1 decode: {b1}")
    if "llamacpp" in r and r["llamacpp"].get("runs"):
        lines.append("llama.cpp runs (continuous batching), tok/s: "
                     + ", ".join(f"{x['max_seqs']} slots: {x['tok_s']}" for x in r["llamacpp"]["runs"]))
    if "llama_cpp_error" in r:
        lines.append(f"llama.cpp left out: {r['llama_cpp_error']}")
    for quant in ("int8", "gguf"):
        if f"{quant}_decode_b1_tok_s" in r:
            lines.append(f"{quant} weights: batch-1 decode {r[f'{quant}_decode_b1_tok_s']} tok/s "
                         f"({r.get(f'{quant}_decode_b1_ratio_vs_bf16', '-')}x {r['dtype']})")
    if "kv_int8_blocks" in r:
        lines.append(f"int8 KV cache: {r['kv_int8_blocks']} blocks in the memory of {r['kv_blocks']} "
                     f"({r['kv_int8_blocks_ratio']}x); batch-1 decode after {r['kv_context_tokens']} tokens "
                     f"{r['kv_int8_decode_long_tok_s']} tok/s vs {r['decode_long_tok_s']} "
                     f"({r.get('kv_int8_decode_long_ratio_vs_bf16', '-')}x)"
                     + (f"; perplexity {r['kv_int8_ppl']} ({r['kv_int8_ppl_ratio_vs_bf16']}x)" if "kv_int8_ppl" in r else ""))
    if "ppl" in r:
        lines.append(f"perplexity over {r['ppl_tokens']} tokens of {r['ppl_text']}: {r['dtype']} {r['ppl']}" + "".join(
            f", {q} weights {r[f'{q}_ppl']} ({r[f'{q}_ppl_ratio_vs_bf16']}x)" for q in ("int8", "gguf") if f"{q}_ppl" in r))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    result = collect(args)
    result_files.save("engine", result, args)
    print(json.dumps(result) if args.json else render(result))
    return 0


def _list(kind, choices=None):
    def parse(text: str) -> list:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("expected a comma-separated list")
        values = [kind(x) for x in items]
        bad = [v for v in values if choices is not None and v not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad[0]!r} is not one of {', '.join(choices)}")
        return values
    return parse


def add_parser(sub) -> None:
    p = sub.add_parser("engine", help="engine throughput and batch-1 decode vs HF transformers and llama.cpp",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (llama.cpp runs only on it)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="pdserve's dtype")
    p.add_argument("--sections", type=_list(str, SECTIONS), default=list(SECTIONS),
                   help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    p.add_argument("--quantization", type=_list(str, ("none", "int8", "gguf")), default=["int8", "gguf"],
                   help="quantized variants of pdserve to measure besides --dtype (default int8,gguf; none: skip; "
                        "gguf only for the default model, whose GGUF file llama.cpp reads too)")
    p.add_argument("--requests", type=at_least_one, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-dtypes", type=_list(str, ("fp32", "bf16")), default=["fp32", "bf16"],
                   help="HF dtypes to try (default fp32,bf16: which is faster depends on the CPU)")
    p.add_argument("--hf-batch-sizes", type=_list(at_least_one), default=[16, 64],
                   help="HF static batch sizes to try per dtype, length-bucketed (default 16,64)")
    p.add_argument("--llamacpp-seqs", type=_list(at_least_one), default=[16, 64],
                   help="llama.cpp sequence slots to try for the mixed workload (default 16,64)")
    p.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp even if llama-cpp-python is installed")
    p.add_argument("--max-output-tokens", type=at_least_one, default=256,
                   help="cap on each workload request's output length (drawn from 16-256; a quick run: 8)")
    p.add_argument("--decode-tokens", type=at_least_one, default=128)
    p.add_argument("--ppl-tokens", type=at_least_one, default=4096, help="tokens of the perplexity text")
    p.add_argument("--kv-context", type=at_least_one, default=4096,
                   help="context of the int8-KV decode comparison, tokens of the perplexity text (default 4096)")
    p.add_argument("--max-num-seqs", type=at_least_one, default=128)
    p.add_argument("--max-num-batched-tokens", type=at_least_one, default=1024)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
