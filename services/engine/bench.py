"""``pdserve bench engine``: pdserve's engine against HF transformers ``generate`` in one run.

Workload (seeded): N requests with random prompts of 32-512 tokens and target
outputs of 16-256 tokens; every request produces exactly its target (EOS
ignored on both sides). Only target tokens count as output: the tokens a
static batch generates past a request's target are padding, which is the cost
continuous batching removes. HF runs static batches of ``--hf-batch-size`` in
arrival order, left-padded, same dtype; the default, 64 (every request of the
default workload in one batch), was HF's fastest on the project's 2-core CPU
(55.7 output tok/s, against 50.3 with 32 and 43-46 with 16), so pdserve is
compared with HF at its best. Batch-1 decode: one prompt, tokens/s
after the first token. llama-cpp-python joins as a third column if installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time

import torch

from services.bench import results as result_files
from services.bench.args import at_least_one
from services.config import EngineConfig
from services.engine.sampling_params import SamplingParams


def make_workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab - 100) for _ in range(rng.randint(32, 512))], rng.randint(16, 256))
            for _ in range(n)]


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


def pdserve_decode_b1(engine, prompt: list[int], n: int) -> float:
    engine.add_request("b1", prompt, SamplingParams(max_tokens=n + 1, temperature=0, ignore_eos=True))
    while engine.requests["b1"].num_output_tokens == 0:
        engine.step()
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return n / (time.perf_counter() - t)


# ---- HF transformers -------------------------------------------------------
def hf_mixed(model, workload, batch_size: int, pad_id: int) -> float:
    useful = 0
    t = time.perf_counter()
    for start in range(0, len(workload), batch_size):
        batch = workload[start : start + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        new = max(o for _, o in batch)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=pad_id)
        useful += sum(o for _, o in batch)
    return useful / (time.perf_counter() - t)


def hf_decode_b1(model, prompt: list[int], n: int, pad_id: int) -> float:
    ids = torch.tensor([prompt])
    kw = dict(do_sample=False, pad_token_id=pad_id)
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=1, **kw)
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=n + 1, min_new_tokens=n + 1, **kw)
    return n / (time.perf_counter() - t - t1)


# ---- llama.cpp (optional) --------------------------------------------------
def llama_cpp_columns(gguf_path: str, workload, prompt: list[int], n: int, threads: int) -> dict[str, float]:
    from llama_cpp import Llama

    llm = Llama(model_path=gguf_path, n_ctx=1024, n_threads=threads, verbose=False)

    def gen(p, k):
        llm.reset()
        toks = 0
        for _ in llm.generate(p, temp=0.0):
            toks += 1
            if toks >= k:
                break

    t = time.perf_counter()
    gen(prompt, 1)
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    gen(prompt, n + 1)
    b1 = n / (time.perf_counter() - t - t1)
    t = time.perf_counter()
    for p, o in workload:
        gen(p, o)
    return {"llama_cpp_tok_s": sum(o for _, o in workload) / (time.perf_counter() - t), "llama_cpp_decode_b1_tok_s": b1}


def isolated_llama_cpp_columns(gguf_path: str, workload, prompt: list[int], n: int) -> dict:
    """llama.cpp's columns from a child process: a llama-cpp-python build that crashes (one
    compiled on this machine segfaulted in llama_decode) costs its column, not the whole run."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(llama_cpp_columns, gguf_path, workload, prompt, n, torch.get_num_threads()).result()
        except BrokenProcessPool:
            why = "its process died (a crash inside llama-cpp-python)"
        except Exception as e:  # noqa: BLE001 - an optional baseline's failure is reported, not raised
            why = f"{type(e).__name__}: {e}"
    _log(f"llama.cpp column left out: {why}")
    return {"llama_cpp_error": why}


def run(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM

    from services.engine.engine import Engine
    from services.engine.kv_cache import dtype_from_name
    from services.engine.model_source import default_model_path

    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.max_num_batched_tokens))
    vocab = engine.model_config.vocab_size
    workload = make_workload(args.requests, args.seed, vocab)
    b1_prompt = workload[0][0][:64]
    if engine.source.weights_dir is None:
        raise ValueError("bench engine needs real weights for the HF baseline; dummy models are for bench gpu")
    hf = AutoModelForCausalLM.from_pretrained(engine.source.weights_dir,
                                              dtype=dtype_from_name(engine.config.dtype)).eval()
    pad_id = engine.eos_token_ids[0] if engine.eos_token_ids else 0
    _log(f"{engine.model_name} {engine.config.dtype}, {torch.get_num_threads()} threads, {len(workload)} requests, "
         f"{sum(len(p) for p, _ in workload)} prompt / {sum(o for _, o in workload)} output tokens")

    with torch.inference_mode():
        _log("warm-up")
        pdserve_mixed(engine, make_workload(4, args.seed + 1, vocab))
        hf_mixed(hf, make_workload(2, args.seed + 1, vocab)[:2], 2, pad_id)
        _log("batch-1 decode: pdserve")
        pd_b1 = pdserve_decode_b1(engine, b1_prompt, args.decode_tokens)
        _log("batch-1 decode: HF")
        hf_b1 = hf_decode_b1(hf, b1_prompt, args.decode_tokens, pad_id)
        _log("mixed workload: pdserve")
        pd_tput = pdserve_mixed(engine, workload)
        _log(f"mixed workload: HF (static batches of {args.hf_batch_size})")
        hf_tput = hf_mixed(hf, workload, args.hf_batch_size, pad_id)

    result = {
        "model": engine.model_name, "dtype": engine.config.dtype, "threads": torch.get_num_threads(),
        "requests": len(workload), "hf_batch_size": args.hf_batch_size,
        "pdserve_tok_s": round(pd_tput, 1), "hf_tok_s": round(hf_tput, 1),
        "throughput_ratio_vs_hf": round(pd_tput / hf_tput, 2),
        "pdserve_decode_b1_tok_s": round(pd_b1, 1), "hf_decode_b1_tok_s": round(hf_b1, 1),
        "decode_b1_ratio_vs_hf": round(pd_b1 / hf_b1, 2),
    }
    if importlib.util.find_spec("llama_cpp") is not None and args.model is None:
        _log("llama.cpp (sequential; no batching in its Python API)")
        lc = isolated_llama_cpp_columns(str(default_model_path()), workload, b1_prompt, args.decode_tokens)
        result.update({k: round(v, 1) if isinstance(v, float) else v for k, v in lc.items()})
    result_files.save("engine", result, args)
    if args.json:
        print(json.dumps(result))
    else:
        cols = ["pdserve", "HF"] + (["llama.cpp"] if "llama_cpp_tok_s" in result else [])
        print(f"{'':28}" + "".join(f"{c:>12}" for c in cols) + f"{'ratio':>10}")
        rows = [("mixed workload, out tok/s", "pdserve_tok_s", "hf_tok_s", "llama_cpp_tok_s", "throughput_ratio_vs_hf"),
                ("batch-1 decode, tok/s", "pdserve_decode_b1_tok_s", "hf_decode_b1_tok_s",
                 "llama_cpp_decode_b1_tok_s", "decode_b1_ratio_vs_hf")]
        for label, a, b, c, r in rows:
            vals = [result[a], result[b]] + ([result[c]] if c in result else [])
            print(f"{label:28}" + "".join(f"{v:>12.1f}" for v in vals) + f"{result[r]:>9.2f}x")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("engine", help="engine throughput and batch-1 decode vs HF transformers",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--requests", type=at_least_one, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-batch-size", type=at_least_one, default=64,
                   help="requests per HF generate call (default 64: HF's fastest here)")
    p.add_argument("--decode-tokens", type=at_least_one, default=128)
    p.add_argument("--max-num-seqs", type=at_least_one, default=128)
    p.add_argument("--max-num-batched-tokens", type=at_least_one, default=1024)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
