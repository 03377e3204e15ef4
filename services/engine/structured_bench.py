"""``pdserve bench structured``: what structured output costs, and whether its output validates.

One engine (the default model, bf16 unless told), the schemas of
``services/bench/structured_schemas.json`` (24 realistic ones: nested objects, enums, arrays,
optional fields, string formats and patterns):

- per-token overhead: decode steps of a batch of B requests (B = 1 and 8), constrained
  (each request its own schema) and unconstrained (the same prompts), alternating in
  ``--rounds`` rounds so drift cancels; only steps where all B requests decode count. The
  overhead is the median step time constrained over unconstrained, minus one (goal: under
  10% at batch 8). The grammar masks are computed while the forward runs (grammar_masks.py),
  so what remains is the wait for them, turning them into a tensor and masking the logits.
  Each step is timed in wall time and in the process's CPU time (the mask thread's included),
  which a shared machine disturbs far less.
- compile time per schema: cold (a fresh compiler) and cached (the same spec again).
- validity: every schema once, greedy, up to ``--max-tokens``; the output must parse and
  validate against its schema with ``jsonschema``. The fraction counts every output; those
  cut by max_tokens mid-object (finish_reason "length") are counted apart, since they are
  a prefix by design and cannot parse.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from services.bench import results as result_files
from services.bench.args import at_least_one
from services.bench.stats import percentile
from services.config import EngineConfig
from services.engine.sampling_params import SamplingParams
from services.engine.structured_output import StructuredOutput

SCHEMAS = Path(__file__).resolve().parents[1] / "bench" / "structured_schemas.json"


def _log(msg: str) -> None:
    print(f"[bench structured] {msg}", file=sys.stderr, flush=True)


def load_schemas() -> list[dict]:
    return json.loads(SCHEMAS.read_text())["schemas"]


def _prompt(tok, case: dict) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": case["prompt"] + " Answer with JSON only."}])


def decode_steps(engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each step in which every request decodes (none prefilling, none
    finished). CPU time is the whole process's, the mask thread's included: on a shared machine
    it moves far less than wall time."""
    ids = [f"s{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(rid, prompt, p)
    times = []
    while engine.has_unfinished():
        full = len(engine.requests) == len(ids) and all(r.num_output_tokens >= 1 for r in engine.requests.values())
        t0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        if full:
            times.append((time.perf_counter() - t0, time.process_time() - c0))
    return times


def overhead(engine, schemas: list[dict], batch: int, rounds: int, steps: int) -> dict:
    tok = engine.tokenizer
    free, constrained = [], []
    for r in range(rounds):
        cases = [schemas[(r * batch + i) % len(schemas)] for i in range(batch)]
        prompts = [_prompt(tok, c) for c in cases]
        base = dict(max_tokens=steps, temperature=0)
        free += decode_steps(engine, prompts, [SamplingParams(**base, ignore_eos=True)] * batch)
        constrained += decode_steps(engine, prompts, [
            SamplingParams(**base, structured=StructuredOutput.json_schema(c["schema"])) for c in cases])
    out = {"batch": batch, "steps_free": len(free), "steps_constrained": len(constrained)}
    for i, clock in enumerate(("wall", "cpu")):
        f = [t[i] * 1e3 for t in free]
        c = [t[i] * 1e3 for t in constrained]
        out.update({f"{clock}_ms_free_p50": round(percentile(f, 50), 3),
                    f"{clock}_ms_constrained_p50": round(percentile(c, 50), 3),
                    f"{clock}_ms_free_p90": round(percentile(f, 90), 3),
                    f"{clock}_ms_constrained_p90": round(percentile(c, 90), 3),
                    f"{clock}_overhead": round(percentile(c, 50) / percentile(f, 50) - 1, 4)})
    return out


def compile_times(engine, schemas: list[dict]) -> dict:
    from services.engine.grammar import GrammarCompiler

    compiler = GrammarCompiler(engine.tokenizer.backend.to_str(), engine.model_config.vocab_size,
                               engine.eos_token_ids)
    compiler.tokenizer  # noqa: B018  (the tokenizer's conversion is set-up, not compile time)
    cold, cached = [], []
    for case in schemas:
        spec = StructuredOutput.json_schema(case["schema"])
        t0 = time.perf_counter()
        compiler.matcher(spec)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        compiler.matcher(spec)
        cached.append(time.perf_counter() - t0)
    ms = lambda xs, q: round(percentile(xs, q) * 1e3, 4)  # noqa: E731
    return {"schemas": len(schemas), "cold_ms_p50": ms(cold, 50), "cold_ms_max": round(max(cold) * 1e3, 3),
            "cached_ms_p50": ms(cached, 50), "cached_ms_max": round(max(cached) * 1e3, 4)}


def validity(engine, schemas: list[dict], max_tokens: int, batch: int) -> dict:
    import jsonschema

    tok = engine.tokenizer
    per_schema = []
    for start in range(0, len(schemas), batch):
        group = schemas[start:start + batch]
        text = {c["name"]: "" for c in group}
        finish = {}
        for c in group:
            engine.add_request(f"v-{c['name']}", _prompt(tok, c), SamplingParams(
                max_tokens=max_tokens, temperature=0, structured=StructuredOutput.json_schema(c["schema"])))
        while engine.has_unfinished():
            for out in engine.step():
                name = out.request_id[2:]
                text[name] += out.new_text
                if out.finished:
                    finish[name] = out.finish_reason
        for c in group:
            try:
                jsonschema.validate(json.loads(text[c["name"]]), c["schema"])
                valid, error = True, None
            except (ValueError, jsonschema.ValidationError) as exc:
                valid, error = False, str(exc).splitlines()[0][:160]
            per_schema.append({"name": c["name"], "finish_reason": finish[c["name"]], "valid": valid,
                               "error": error, "output": text[c["name"]]})
    stopped = [s for s in per_schema if s["finish_reason"] == "stop"]
    return {"outputs": len(per_schema), "valid": sum(s["valid"] for s in per_schema),
            "valid_fraction": round(sum(s["valid"] for s in per_schema) / len(per_schema), 4),
            "stopped": len(stopped), "valid_fraction_of_stopped":
                round(sum(s["valid"] for s in stopped) / len(stopped), 4) if stopped else None,
            "cut_by_max_tokens": sum(s["finish_reason"] == "length" for s in per_schema),
            "max_tokens": max_tokens, "per_schema": per_schema}


def run(args: argparse.Namespace) -> int:
    from services.engine.engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_bytes=int(args.kv_cache_gb * 2**30),
                                 max_num_seqs=max(8, *args.batches)))
    if engine.tokenizer is None:
        raise ValueError(f"{engine.model_name} has no tokenizer; structured output needs one")
    schemas = load_schemas()
    _log(f"{engine.model_name}, {engine.describe()}, {torch.get_num_threads()} threads, {len(schemas)} schemas")
    result: dict = {"model": engine.model_name, "dtype": engine.config.dtype, "threads": torch.get_num_threads(),
                    "grammar_engine": "llguidance", "schemas": len(schemas)}
    with torch.inference_mode():
        result["compile"] = compile_times(engine, schemas)
        _log(f"compile: cold p50 {result['compile']['cold_ms_p50']} ms, cached p50 "
             f"{result['compile']['cached_ms_p50']} ms")
        decode_steps(engine, [_prompt(engine.tokenizer, schemas[0])], [SamplingParams(max_tokens=8)])  # warm-up
        for batch in args.batches:
            case = overhead(engine, schemas, batch, args.rounds, args.steps)
            result[f"overhead_b{batch}"] = case
            _log(f"batch {batch}: wall {case['wall_ms_free_p50']} ms free, {case['wall_ms_constrained_p50']} ms "
                 f"constrained ({case['wall_overhead']:+.1%}); CPU {case['cpu_ms_free_p50']} ms, "
                 f"{case['cpu_ms_constrained_p50']} ms ({case['cpu_overhead']:+.1%})")
        result["validity"] = validity(engine, schemas, args.max_tokens, 8)
        v = result["validity"]
        _log(f"validity: {v['valid']}/{v['outputs']} valid, {v['cut_by_max_tokens']} cut by max_tokens")
    result_files.report("structured", result, args, _table)
    return 0


def _table(result: dict) -> None:
    c = result["compile"]
    print(f"schema compile: cold p50 {c['cold_ms_p50']} ms (max {c['cold_ms_max']}), "
          f"cached p50 {c['cached_ms_p50']} ms")
    print(f"{'batch':>6}{'clock':>6}{'free ms/step':>14}{'constrained':>13}{'overhead':>10}")
    for key in sorted(k for k in result if k.startswith("overhead_b")):
        o = result[key]
        for clock in ("wall", "cpu"):
            print(f"{o['batch']:>6}{clock:>6}{o[clock + '_ms_free_p50']:>14.2f}"
                  f"{o[clock + '_ms_constrained_p50']:>13.2f}{o[clock + '_overhead']:>+10.1%}")
    v = result["validity"]
    print(f"valid: {v['valid']}/{v['outputs']} ({v['valid_fraction']:.0%}); of those ending on the grammar's "
          f"end: {v['valid_fraction_of_stopped']}; cut by max_tokens={v['max_tokens']}: {v['cut_by_max_tokens']}")


def add_parser(sub) -> None:
    p = sub.add_parser("structured", help="structured output: per-token overhead, compile time, validity",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--batches", type=at_least_one, nargs="+", default=[1, 8], help="batch sizes (default: 1 8)")
    p.add_argument("--rounds", type=at_least_one, default=3, help="free / constrained rounds per batch size")
    p.add_argument("--steps", type=at_least_one, default=48, help="tokens per request in the overhead rounds")
    p.add_argument("--max-tokens", type=at_least_one, default=384, help="tokens per output in the validity run")
    p.add_argument("--kv-cache-gb", type=float, default=0.5)
    p.add_argument("--threads", type=at_least_one, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
