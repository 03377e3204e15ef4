"""``pdserve bench gpu``: the engine on one GPU against its bandwidth floor and against HF, in one run.

Default model ``dummy:llama-3.2-1b`` (the real shapes, seeded random weights)
in bf16. Three sections, each printed side by side with its reference:

decode
    ``Engine.step`` time of a decode-only batch (B = 1, 8, 64, 256 sequences
    at context C = 512, 4096), with CUDA graphs and eagerly. The sequences are
    real engine requests (``reserve`` + ``start_decode``: blocks from the block
    pool, KV left as it is), so every step takes the production path:
    scheduler, runner, graph replay, sampler. C is the context of the last
    timed step (earlier ones are up to ``--decode-steps`` shorter).
    floor = bytes read per step / measured copy bandwidth, where bytes = every
    weight once (with tied embeddings the table is the lm_head; untied, only B
    embedding rows are read) + the K and V of every context token in every
    layer. MBU (model bandwidth utilisation) = floor / step time.
    Copy bandwidth = 2 x bytes / time of a 1 GiB device-to-device copy
    (read + write), the best of 5 timed with CUDA events.

attention
    One layer of paged decode attention (the Triton kernel the engine runs,
    on a block table of shuffled blocks) against
    ``torch.nn.functional.scaled_dot_product_attention`` on contiguous K/V of
    the same tokens, with the query heads of a kv head as its query rows (the
    GQA layout SDPA's fused kernels take). Times are per call from one CUDA
    graph of back-to-back calls (no launch gaps), each call reading another
    layer's K/V so that repeated calls do not hit in L2 (at least 512 MiB
    streamed per graph). Bandwidth = K + V bytes / time.

mixed
    The engine issue's workload (services.engine.bench: seeded prompts of
    32-512 tokens, outputs of 16-256, EOS ignored), scaled to ``--requests``,
    through the engine under continuous batching, against HF transformers
    ``generate`` in static batches of ``--hf-batch-size`` on the same GPU with
    the same weights (services.engine.hf_baseline). Output tokens per second.

Headline keys (``--json``): ``mbu_b1`` (the lower of batch 1 at both
contexts, with graphs), ``attn_bw_frac_4k`` (paged attention bandwidth over
copy bandwidth at batch 64, context 4096), ``throughput_ratio_vs_hf``.
Goals on an H100 with the 1B model in bf16: >= 0.65, >= 0.70, >= 10.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time

import torch

from services.bench import results as result_files
from services.bench.args import counts
from services.config import EngineConfig
from services.engine.sampling_params import SamplingParams

GOALS = {"mbu_b1": 0.65, "attn_bw_frac_4k": 0.70, "throughput_ratio_vs_hf": 10.0}
HEADLINE_ATTN = (64, 4096)  # (batch, context) of attn_bw_frac_4k
SECTIONS = ("decode", "attention", "mixed")
_STREAM_BYTES = 512 << 20  # K/V read per attention timing graph, well past any L2
_MAX_LAYERS = 512


def _log(msg: str) -> None:
    print(f"[bench gpu] {msg}", file=sys.stderr, flush=True)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


# ---- copy bandwidth ---------------------------------------------------------
def copy_bandwidth(device: str, nbytes: int = 1 << 30, trials: int = 5, reps: int = 10) -> float:
    """Bytes per second moved (read + write) by a device-to-device copy, the best of ``trials``."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = 0.0
    for _ in range(trials):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            t = time.perf_counter()
            for _ in range(reps):
                dst.copy_(src)
            seconds = time.perf_counter() - t
        best = max(best, 2 * nbytes * reps / seconds)
    return best


# ---- decode -----------------------------------------------------------------
def weight_bytes_read(model, batch: int) -> int:
    """Bytes of weights one decode step reads: all of them, except that an untied
    embedding table is only gathered (``batch`` rows)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        emb = model.embed_tokens.weight
        total -= (emb.shape[0] - batch) * emb.shape[1] * emb.element_size()
    return total


def decode_step_times(engine, batch: int, context: int, warmup: int, steps: int, seed: int) -> list[float]:
    """Wall seconds of ``steps`` Engine.step calls over ``batch`` decoding sequences whose
    last step attends to ``context`` tokens. Leaves the engine as it found it."""
    from services.errors import CapacityError

    prompt_len = context - warmup - steps
    if prompt_len < 1:
        raise ValueError(f"context {context} is too short for {warmup} + {steps} decode steps")
    bs = engine.config.block_size
    need = batch * -(-context // bs)
    if need > engine.block_pool.num_free:
        raise CapacityError(f"batch {batch} at context {context} needs {need} KV blocks; "
                            f"{engine.block_pool.num_free} are free")
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    ids: list[str] = []
    try:
        for i in range(batch):
            prompt = torch.randint(100, vocab - 100, (prompt_len,), generator=gen).tolist()
            rid = f"bench-decode-{i}"
            engine.reserve(rid, prompt, params)
            ids.append(rid)
            engine.start_decode(rid, prompt[-1])
        for _ in range(warmup):
            engine.step()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()  # the sampler reads the tokens back: each step ends synchronised
            times.append(time.perf_counter() - t)
        if engine.scheduler.num_running != batch:
            raise RuntimeError(f"expected {batch} decoding sequences, found {engine.scheduler.num_running}")
    finally:
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
    return times


def decode_row(engine, batch: int, context: int, copy_bw: float, steps: int, seed: int) -> dict:
    warmup = 3
    kv_per_token = engine.kv_spec.block_bytes // engine.kv_spec.block_size
    mean_context = context - (steps - 1) / 2
    nbytes = weight_bytes_read(engine.model, batch) + batch * mean_context * kv_per_token
    floor = nbytes / copy_bw
    graphs = engine.runner.cuda_graphs
    graph_t = statistics.median(decode_step_times(engine, batch, context, warmup, steps, seed))
    engine.runner.cuda_graphs = None
    try:
        eager_t = statistics.median(decode_step_times(engine, batch, context, warmup, steps, seed))
    finally:
        engine.runner.cuda_graphs = graphs
    return {"batch": batch, "context": context, "bytes_per_step": int(nbytes), "floor_ms": floor * 1e3,
            "graph_ms": graph_t * 1e3, "mbu": floor / graph_t, "eager_ms": eager_t * 1e3, "eager_mbu": floor / eager_t}


# ---- attention --------------------------------------------------------------
def _device_seconds(fn, calls: int, trials: int = 5) -> float:
    """Seconds per call of ``fn(i)``, i = 0..calls-1, replayed from one CUDA graph (no launch
    gaps between calls); the median of ``trials`` replays."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000 / calls)
    return statistics.median(times)


def contiguous_kv(cache: torch.Tensor, block_table: torch.Tensor, context: int) -> torch.Tensor:
    """The first ``context`` tokens of each sequence's blocks as one contiguous
    ``[num_seqs, kv_heads, context, head_dim]`` tensor (SDPA's layout)."""
    num_seqs, width = block_table.shape
    block_size, kv_heads, head_dim = cache.shape[1:]
    tokens = cache[block_table.long()].reshape(num_seqs, width * block_size, kv_heads, head_dim)
    return tokens[:, :context].transpose(1, 2).contiguous()


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention through SDPA: ``q [S, H, D]`` over ``k, v [S, Hkv, ctx, D]``, out
    ``[S, Hkv, H / Hkv, D]`` (``.view(S, H, D)`` gives the paged kernel's layout).

    The H / Hkv query heads that share a kv head are the query rows of that
    head (query head h reads kv head h // (H / Hkv), as in the paged kernel),
    so SDPA runs plain multi-head attention, which its fused kernels take."""
    import torch.nn.functional as F

    num_seqs, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    rows = q.view(num_seqs, kv_heads, heads // kv_heads, head_dim)
    return F.scaled_dot_product_attention(rows, k, v, scale=scale)


@torch.inference_mode()
def attention_row(model_config, dtype: torch.dtype, block_size: int, batch: int, context: int,
                  copy_bw: float, seed: int) -> dict:
    from kernels.paged_attention import paged_decode_attention
    from services.engine.kv_cache import (
        KVCacheSpec,
        allocate_kv_cache,
        dtype_name,
        layer_view,
    )

    heads, kv_heads, head_dim = model_config.num_heads, model_config.num_kv_heads, model_config.head_dim
    kv_bytes = 2 * batch * context * kv_heads * head_dim * dtype.itemsize  # one layer's K + V
    layers = max(1, min(_MAX_LAYERS, math.ceil(_STREAM_BYTES / kv_bytes)))
    blocks_per_seq = -(-context // block_size)
    num_blocks = 1 + batch * blocks_per_seq
    gen = torch.Generator().manual_seed(seed)
    kv = allocate_kv_cache(KVCacheSpec(layers, kv_heads, head_dim, block_size, dtype_name(dtype)), num_blocks, "cuda")
    kv.normal_()
    caches = [layer_view(kv, i) for i in range(layers)]
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(batch, blocks_per_seq)
    table = table.to(device="cuda", dtype=torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, head_dim, generator=gen).to(device="cuda", dtype=dtype)
    scale = head_dim**-0.5

    # The same tokens, contiguous: [layer, batch, kv_head, context, head_dim].
    k = torch.stack([contiguous_kv(kc, table, context) for kc, _ in caches])
    v = torch.stack([contiguous_kv(vc, table, context) for _, vc in caches])

    def paged(i: int) -> torch.Tensor:
        kc, vc = caches[i % layers]
        return paged_decode_attention(q, kc, vc, table, lens, scale)

    def sdpa(i: int) -> torch.Tensor:
        return sdpa_decode(q, k[i % layers], v[i % layers], scale)

    diff = (paged(0).float() - sdpa(0).reshape(batch, heads, head_dim).float()).abs().max().item()
    calls = max(layers, 10)
    t_paged, t_sdpa = _device_seconds(paged, calls), _device_seconds(sdpa, calls)
    return {"batch": batch, "context": context, "kv_bytes": kv_bytes, "paged_us": t_paged * 1e6,
            "sdpa_us": t_sdpa * 1e6, "speedup_vs_sdpa": t_sdpa / t_paged,
            "paged_gbs": kv_bytes / t_paged / 1e9, "paged_bw_frac": kv_bytes / t_paged / copy_bw,
            "sdpa_gbs": kv_bytes / t_sdpa / 1e9, "sdpa_bw_frac": kv_bytes / t_sdpa / copy_bw,
            "max_abs_diff": diff}


# ---- the run ----------------------------------------------------------------
def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def collect(args: argparse.Namespace, device: str) -> dict:
    """Run the requested sections on ``device``; the result object ``--json`` prints.

    The attention section needs CUDA; decode and mixed also run on CPU (a smoke
    test of this code, not a benchmark)."""
    from services.engine.bench import make_workload, pdserve_mixed
    from services.engine.bench_hf import hf_mixed
    from services.engine.engine import Engine
    from services.engine.hf_baseline import DeviceGenerate, hf_twin

    sections = set(args.sections)
    on_cuda = device.startswith("cuda")
    torch.manual_seed(args.seed)
    if "attention" in sections and not on_cuda:
        raise ValueError("the attention section needs CUDA")
    result: dict = {"device": torch.cuda.get_device_name(device) if on_cuda else "cpu",
                    "model": args.model, "dtype": None, "torch": torch.__version__}
    _log(f"device {result['device']}: measuring copy bandwidth")
    copy_bw = copy_bandwidth(device, nbytes=(1 << 30) if on_cuda else (64 << 20))
    result["copy_bw_gbs"] = copy_bw / 1e9
    _free(device)  # the copy's 2 GiB back to the driver before the engine sizes its KV cache

    _log(f"loading {args.model} ({args.dtype}); CUDA graphs are captured at engine start")
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, device=device, max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.max_num_batched_tokens,
                                 kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)) if args.kv_cache_gb else None))
    result["dtype"] = engine.config.dtype
    graphs = engine.runner.cuda_graphs
    result["cuda_graphs"] = graphs.num_graphs if graphs is not None else 0
    model_config, block_size, dtype = engine.model_config, engine.config.block_size, engine.kv_spec.torch_dtype

    if "decode" in sections:
        result["decode"] = []
        for c in args.contexts:
            for b in args.batches:
                _log(f"decode: batch {b}, context {c}")
                result["decode"].append(decode_row(engine, b, c, copy_bw, args.decode_steps, args.seed))

    hf = None
    if "mixed" in sections:
        vocab = model_config.vocab_size
        workload = make_workload(args.requests, args.seed, vocab)
        with torch.inference_mode():
            _log(f"mixed workload: pdserve warm-up ({args.warmup_requests} requests)")
            pdserve_mixed(engine, make_workload(args.warmup_requests, args.seed + 1, vocab))
            _log(f"mixed workload: pdserve, {len(workload)} requests")
            t = time.perf_counter()
            pd_tput = pdserve_mixed(engine, workload)
            pd_s = time.perf_counter() - t
        hf = hf_twin(engine.model)
        result["mixed"] = {"requests": len(workload), "prompt_tokens": sum(len(p) for p, _ in workload),
                           "output_tokens": sum(o for _, o in workload), "pdserve_tok_s": pd_tput,
                           "pdserve_s": pd_s, "hf_batch_size": args.hf_batch_size}
    pad_id = engine.eos_token_ids[0] if engine.eos_token_ids else 0
    del engine, graphs
    _free(device)

    if "attention" in sections:
        result["attention"] = []
        for c in args.contexts:
            for b in args.batches:
                _log(f"attention: batch {b}, context {c}")
                result["attention"].append(attention_row(model_config, dtype, block_size, b, c, copy_bw, args.seed))
                _free(device)  # up to several GiB of K/V per row

    if hf is not None:
        gen_hf = DeviceGenerate(hf)
        with torch.inference_mode():
            _log("mixed workload: HF warm-up")
            hf_mixed(gen_hf, make_workload(2, args.seed + 1, model_config.vocab_size), 2, pad_id)
            _log(f"mixed workload: HF generate, static batches of {args.hf_batch_size}")
            t = time.perf_counter()
            hf_tput = hf_mixed(gen_hf, workload, args.hf_batch_size, pad_id)
            _sync(device)
            result["mixed"].update(hf_tok_s=hf_tput, hf_s=time.perf_counter() - t)
        result["throughput_ratio_vs_hf"] = result["mixed"]["pdserve_tok_s"] / hf_tput
        del hf, gen_hf
        _free(device)

    b1 = [r["mbu"] for r in result.get("decode", []) if r["batch"] == 1]
    if b1:
        result["mbu_b1"] = min(b1)
    attn = [r for r in result.get("attention", []) if (r["batch"], r["context"]) == HEADLINE_ATTN]
    if attn:
        result["attn_bw_frac_4k"] = attn[0]["paged_bw_frac"]
    return result


def render(result: dict) -> str:
    """The human-readable table."""
    lines = [(f"pdserve bench gpu | {result['device']} | {result['model']} {result['dtype']} | "
              f"copy bandwidth {result['copy_bw_gbs']:.0f} GB/s (read + write) | {result['cuda_graphs']} CUDA graphs")]
    if "decode" in result:
        lines += ["", "Decode step (Engine.step), CUDA graphs vs eager; floor = (weights + KV read) / copy bandwidth",
                  f"{'batch':>6}{'context':>9}{'floor ms':>10}{'graphs ms':>11}{'MBU':>8}{'eager ms':>10}{'MBU':>8}"]
        for r in result["decode"]:
            lines.append(f"{r['batch']:>6}{r['context']:>9}{r['floor_ms']:>10.3f}{r['graph_ms']:>11.3f}"
                         f"{r['mbu']:>8.1%}{r['eager_ms']:>10.3f}{r['eager_mbu']:>8.1%}")
    if "attention" in result:
        lines += ["", "Paged decode attention (one layer) vs SDPA on contiguous K/V of the same size",
                  (f"{'batch':>6}{'context':>9}{'paged us':>10}{'SDPA us':>10}{'speedup':>9}{'paged GB/s':>12}"
                   f"{'of copy':>9}{'SDPA GB/s':>11}{'of copy':>9}{'max|diff|':>11}")]
        for r in result["attention"]:
            lines.append(f"{r['batch']:>6}{r['context']:>9}{r['paged_us']:>10.1f}{r['sdpa_us']:>10.1f}"
                         f"{r['speedup_vs_sdpa']:>8.2f}x{r['paged_gbs']:>12.0f}{r['paged_bw_frac']:>9.1%}"
                         f"{r['sdpa_gbs']:>11.0f}{r['sdpa_bw_frac']:>9.1%}{r['max_abs_diff']:>11.2e}")
    if "mixed" in result and "hf_tok_s" in result["mixed"]:
        m = result["mixed"]
        lines += ["", (f"Mixed workload: {m['requests']} requests, {m['prompt_tokens']} prompt / "
                       f"{m['output_tokens']} output tokens; output tokens/s"),
                  f"{'pdserve':>12}{'HF generate (batch ' + str(m['hf_batch_size']) + ')':>26}{'ratio':>9}",
                  f"{m['pdserve_tok_s']:>12.1f}{m['hf_tok_s']:>26.1f}{result['throughput_ratio_vs_hf']:>8.1f}x"]
    goals = [f"{k} {result[k]:.2f} (goal >= {g:g})" for k, g in GOALS.items() if k in result]
    if goals:
        lines += ["", "Goals (H100, 1B model, bf16): " + ", ".join(goals)]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise ValueError(f"pdserve bench gpu needs a CUDA GPU, and torch {torch.__version__} sees none "
                         "(torch.cuda.is_available() is False)")
    result = collect(args, "cuda")
    result_files.save("gpu", result, args)
    print(json.dumps(result) if args.json else render(result), flush=True)
    return 0


def _sections(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = set(names) - set(SECTIONS)
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"sections are {', '.join(SECTIONS)}; got {text!r}")
    return names


def add_parser(sub) -> None:
    p = sub.add_parser("gpu", help="decode MBU, paged attention vs SDPA, throughput vs HF, on a CUDA GPU",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy:llama-3.2-1b", help="default: dummy:llama-3.2-1b (random weights)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--batches", type=counts, default=[1, 8, 64, 256], help="decode and attention batch sizes")
    p.add_argument("--contexts", type=counts, default=[512, 4096], help="decode and attention context lengths")
    p.add_argument("--decode-steps", type=int, default=20, help="timed steps per decode row (after 3 warm-up)")
    p.add_argument("--requests", type=int, default=1000, help="mixed workload size")
    p.add_argument("--warmup-requests", type=int, default=64)
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="engine batch limit; decode batches above it run without CUDA graphs")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--kv-cache-gb", type=float, default=None, help="default: 85%% of free GPU memory")
    p.add_argument("--sections", type=_sections, default=list(SECTIONS), help="comma-separated subset of "
                   + ", ".join(SECTIONS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
