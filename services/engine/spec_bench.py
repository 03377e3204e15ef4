"""``pdserve bench spec``: n-gram speculative decoding on and off, side by side in one process.

Two engines with the same model and settings, one with ``--speculative ngram`` (k = 5,
n = 4..1) and one without, run the same greedy requests; runs alternate between them
(ABBA per request or per batch) so machine drift hits both alike. Prefix caching is off in
both, so a prompt costs the same every time it is seen.

Workloads (chat template applied, greedy, up to ``--max-tokens`` each, EOS ends a request):

- **grounded**: the answer is mostly in the prompt. Six Python functions from the standard
  library ("repeat this code with the variable `x` renamed to `y`") and two sections of
  Python's own documentation (``pydoc_data``: "quote the first paragraph exactly"). Text
  depends on the Python version, which the result records.
- **open**: open-ended questions whose answers are not in the prompt.

Each runs at batch 1 (one request at a time) and batch 8 (eight submitted together).

First, a probe of what a draft costs: the median time of a decode step at each batch size
whose requests verify 0, 1, k/2 and k draft tokens (``step_ms_b1`` ...), and the ratio
``break_even_tokens_per_step``: the tokens a verifying step of k drafts must yield (the
model's own included) to beat plain decoding.
Reported per case: output tokens/s from submission to the last token, with and without
speculation, their ratio (``grounded_b1_speedup`` ...), the acceptance rate (accepted / drafted
tokens), the mean accepted length (tokens a verifying step yields, the model's own included),
the share of decode steps that carried a draft, and how many requests gave the baseline's
exact tokens (greedy: all, unless a bf16 near-tie resolves differently in the two runs).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import sys
import time

import torch

from services.bench import results as result_files
from services.bench.args import at_least_one
from services.bench.stats import percentile, ratio
from services.config import EngineConfig, SpeculativeConfig
from services.engine.sampling_params import SamplingParams

CODE = ["textwrap.dedent", "difflib.get_close_matches", "heapq.nsmallest", "statistics.variance",
        "colorsys.rgb_to_hls", "copy.deepcopy"]
DOCS = ["assert", "global"]
OPEN = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are some good habits for staying healthy while working from home?",
    "Explain how airplanes stay in the air, for a ten-year-old.",
    "Describe your ideal weekend in the mountains.",
    "Give me some tips for learning to play the guitar.",
    "Why do people enjoy watching sports?",
    "Write a poem about autumn leaves.",
    "What would a city of the future look like?",
]


def _source(dotted: str) -> tuple[str, str]:
    import importlib

    module, _, name = dotted.rpartition(".")
    fn = getattr(importlib.import_module(module), name)
    src = inspect.getsource(fn)
    args = [a.arg for a in ast.parse(src).body[0].args.args if a.arg != "self"]
    return src, args[0]


def grounded_messages() -> list[str]:
    prompts = []
    for dotted in CODE:
        src, var = _source(dotted)
        new = "value" if var != "value" else "item"
        prompts.append(f"Repeat the following Python code exactly, with the variable `{var}` renamed to "
                       f"`{new}` everywhere:\n\n```python\n{src}```")
    import pydoc_data.topics

    for topic in DOCS:
        prompts.append("Here is a section of the Python documentation:\n\n" + pydoc_data.topics.topics[topic]
                       + "\n\nQuote its first paragraph exactly.")
    return prompts


def _log(msg: str) -> None:
    print(f"[bench spec] {msg}", file=sys.stderr, flush=True)


def run_batch(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]], int]:
    """All prompts at once, to completion: (seconds, tokens per request, decode steps run)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    t = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"b{i}", ids, params)
    out: dict[str, list[int]] = {f"b{i}": [] for i in range(len(prompts))}
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        steps += 1
    return time.perf_counter() - t, [out[f"b{i}"] for i in range(len(prompts))], steps


class _FixedDrafts:
    """Stands in for the engine's Speculator in the step-cost probe: every decoding request drafts
    ``k`` copies of its last token (nearly always rejected, so a step costs what verifying k
    drafts costs and yields one token)."""

    def __init__(self, k: int):
        self.k = k

    def propose(self, running) -> None:
        for req in running:
            decoding = req.num_tokens - req.num_computed_tokens == 1
            req.spec_token_ids = [req.all_token_ids[-1]] * self.k if decoding and self.k else []

    def record(self, *_args) -> None:
        pass

    def forget(self, _request_id: str) -> None:
        pass


def step_cost(engine, prompt: list[int], batch: int, ks: list[int], steps: int) -> dict[int, float]:
    """Median milliseconds of a decode step of ``batch`` requests (``len(prompt)``-token contexts)
    verifying ``k`` drafts each, for each k: what a draft costs, whether or not it is accepted."""
    real = engine.speculator
    out = {}
    try:
        for k in ks:
            engine.speculator = _FixedDrafts(k)
            params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
            for i in range(batch):
                engine.add_request(f"cost{i}", prompt, params)
            while any(r.num_output_tokens == 0 for r in engine.requests.values()):
                engine.step()
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            for rid in list(engine.requests):
                engine.abort(rid)
            engine.step()
            out[k] = round(1000 * percentile(times, 50), 2)
    finally:
        engine.speculator = real
    return out


def measure(engines: dict, prompts: list[list[int]], batch: int, max_tokens: int) -> dict:
    """Both engines over ``prompts`` in batches of ``batch``, alternating which goes first."""
    seconds = {"base": 0.0, "spec": 0.0}
    produced = {"base": 0, "spec": 0}
    outputs: dict[str, list] = {"base": [], "spec": []}
    before = engines["spec"].stats()
    for j, start in enumerate(range(0, len(prompts), batch)):
        group = prompts[start:start + batch]
        order = ("base", "spec") if j % 2 == 0 else ("spec", "base")
        for arm in order:
            dt, toks, _ = run_batch(engines[arm], group, max_tokens)
            seconds[arm] += dt
            produced[arm] += sum(len(t) for t in toks)
            outputs[arm] += toks
    after = engines["spec"].stats()
    drafts = after["spec_drafts"] - before["spec_drafts"]
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    # the speculating engine's decode steps, per request: each emits one token of the model's own
    # (the first token comes from the prefill), plus the accepted drafts of a verifying step
    spec_steps = produced["spec"] - accepted - len(prompts)
    base_tok_s = produced["base"] / seconds["base"]
    spec_tok_s = produced["spec"] / seconds["spec"]
    return {
        "requests": len(prompts), "batch": batch,
        "base_tok_s": round(base_tok_s, 1), "spec_tok_s": round(spec_tok_s, 1),
        "speedup": ratio(spec_tok_s, base_tok_s),
        "base_output_tokens": produced["base"], "spec_output_tokens": produced["spec"],
        "acceptance_rate": ratio(accepted, drafted),
        "mean_accepted_length": round(1 + accepted / drafts, 2) if drafts else None,
        "draft_step_fraction": ratio(drafts, spec_steps),
        "draft_tokens": drafted, "accepted_tokens": accepted,
        "drafting_paused": after["spec_pauses"] - before["spec_pauses"],
        "identical_requests": sum(a == b for a, b in zip(outputs["base"], outputs["spec"])),
    }


def run(args: argparse.Namespace) -> int:
    from services.engine.engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    common = dict(model=args.model, dtype=args.dtype, enable_prefix_caching=False,
                  kv_cache_bytes=int(args.kv_cache_gb * 2**30))
    spec_cfg = SpeculativeConfig(num_speculative_tokens=args.num_speculative_tokens,
                                 prompt_lookup_max=args.prompt_lookup_max, prompt_lookup_min=args.prompt_lookup_min)
    engines = {"base": Engine(EngineConfig(**common)), "spec": Engine(EngineConfig(**common, speculative=spec_cfg))}
    tok = engines["base"].tokenizer
    if tok is None:
        raise ValueError(f"{engines['base'].model_name} has no tokenizer; bench spec needs chat prompts")
    workloads = {"grounded": grounded_messages()[: args.prompts], "open": OPEN[: args.prompts]}
    ids = {name: [tok.apply_chat_template([{"role": "user", "content": m}]) for m in msgs]
           for name, msgs in workloads.items()}
    _log(f"{engines['base'].model_name} {engines['base'].config.dtype}, {torch.get_num_threads()} threads; "
         + ", ".join(f"{n}: {len(p)} prompts of {min(map(len, p))}-{max(map(len, p))} tokens" for n, p in ids.items()))
    with torch.inference_mode():
        for engine in engines.values():  # warm-up: kernels built, first-call costs paid
            run_batch(engine, ids["open"][:2], 8)
        result: dict = {"model": engines["base"].model_name, "dtype": engines["base"].config.dtype,
                        "threads": torch.get_num_threads(), "cpu_model": result_files.machine()["cpu_model"],
                        "num_speculative_tokens": spec_cfg.num_speculative_tokens,
                        "prompt_lookup": [spec_cfg.prompt_lookup_max, spec_cfg.prompt_lookup_min],
                        "max_tokens": args.max_tokens}
        k = spec_cfg.num_speculative_tokens
        ks = sorted({0, 1, (k + 1) // 2, k})
        for batch in args.batches:
            _log(f"step cost, batch {batch}: drafts of {ks} tokens")
            cost = step_cost(engines["spec"], ids["grounded"][0], batch, ks, args.cost_steps)
            result[f"step_ms_b{batch}"] = cost
            # a verifying step must yield this many tokens to pay for itself
            result[f"break_even_tokens_per_step_b{batch}"] = ratio(cost[k], cost[0], 2)
        for batch in args.batches:
            for name, prompts in ids.items():
                _log(f"{name}, batch {batch}")
                case = measure(engines, prompts, batch, args.max_tokens)
                result[f"{name}_b{batch}"] = case
                result[f"{name}_b{batch}_speedup"] = case["speedup"]
                _log(f"  {case['base_tok_s']} -> {case['spec_tok_s']} tok/s ({case['speedup']}x), acceptance "
                     f"{case['acceptance_rate']}, mean accepted length {case['mean_accepted_length']}")
    result_files.save("spec", result, args)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{'':18}{'no spec tok/s':>14}{'ngram tok/s':>13}{'speedup':>9}{'accept':>8}{'mean len':>9}"
              f"{'drafting':>9}{'same':>7}")
        for batch in args.batches:
            for name in ids:
                c = result[f"{name}_b{batch}"]
                print(f"{name + ', batch ' + str(batch):18}{c['base_tok_s']:>14.1f}{c['spec_tok_s']:>13.1f}"
                      f"{c['speedup']:>8.2f}x{c['acceptance_rate'] or 0:>8.2f}{c['mean_accepted_length'] or 0:>9.2f}"
                      f"{c['draft_step_fraction'] or 0:>9.2f}{c['identical_requests']:>4}/{c['requests']}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("spec", help="n-gram speculative decoding on vs off (grounded and open-ended prompts)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--prompts", type=at_least_one, default=8, help="prompts per workload (at most 8)")
    p.add_argument("--batches", type=at_least_one, nargs="+", default=[1, 8], help="batch sizes (default: 1 8)")
    p.add_argument("--max-tokens", type=at_least_one, default=256, help="output tokens per request at most")
    p.add_argument("--num-speculative-tokens", type=at_least_one, default=5)
    p.add_argument("--prompt-lookup-max", type=at_least_one, default=4)
    p.add_argument("--prompt-lookup-min", type=at_least_one, default=1)
    p.add_argument("--cost-steps", type=at_least_one, default=16,
                   help="steps timed per draft length in the step-cost probe")
    p.add_argument("--kv-cache-gb", type=float, default=0.5, help="KV cache per engine")
    p.add_argument("--threads", type=at_least_one, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
