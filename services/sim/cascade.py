"""``pdserve bench cascade``: what ``model: "auto"`` costs, how long it takes and what quality it keeps at
several thresholds, from the simulator's worker models and the small tier's measured confidence.

    escalated share   the measured prompts (cascade_confidence.py: SmolLM2-135M's real first-token
                      log-probabilities) whose signal (mean or min over the first K) is under the threshold
    cost              worker-seconds per request, each tier's batched decode step shared by its batch:
                        kept:      small prefill + output x small step
                        escalated: small prefill + K x small step (thrown away) + large prefill + output x large step
                      reported against sending everything to the large tier (and to the small one)
    latency           the same sums as one request sees them (full steps, no queueing): TTFT, e2e
    quality           the share of the small->large quality gap recovered (PGR, as RouteLLM measures it)
                      when a share f of requests reaches the large tier, two ways:
                        routellm: PGR(f) = 1 - (1 - f)^a, a = 4.05: the curve whose area (APGR) is 0.802,
                                  RouteLLM's best router on MT Bench (matrix factorisation with GPT-4-judge
                                  augmentation; Ong et al. 2024, "RouteLLM: Learning to Route LLMs with
                                  Preference Data", arXiv:2406.18665 v4; the value as a summary of the paper
                                  quotes it, not re-read from its tables here)
                        random:   PGR(f) = f, a router that knows nothing (the floor)
                      The log-probability signal is not RouteLLM's trained router: the first is what it
                      would give if it ranked requests as well, the second what it gives if it ranked
                      them no better than chance. The measured easy/hard split says which it is closer to.

The tiers: the large is a calibration profile (default ``h100``: Llama-3.1-8B on one H100, the
simulator's derived roofline); the small is that profile with every time scaled by
``--small-scale`` (default 0.154 = Llama-3.2-1B's 1.24 B parameters over 8.03 B: decode is memory
bound, so its step time goes as the weights read). Lengths default to the Azure 2023 conversation
trace medians the simulator's workloads use (prompt 1,020, output 129 tokens; workloads.py).
This is a closed form over the worker models, not the event loop: no queueing, no prefix cache.
"""

from __future__ import annotations

import argparse
import dataclasses

from services.bench import results as result_files
from services.bench.stats import percentile
from services.cascade import CascadeSpec
from services.sim import cascade_confidence
from services.sim.profiles import WorkerProfile, load_profile

ROUTELLM_APGR = 0.802  # MT Bench, mf router + GPT-4-judge augmentation (arXiv:2406.18665)
ROUTELLM_EXPONENT = ROUTELLM_APGR / (1 - ROUTELLM_APGR)  # area of 1 - (1 - f)^a is a / (a + 1)
THRESHOLDS = (-0.1, -0.25, -0.5, -0.75, -1.0, -1.5, -2.0)


def scaled(profile: WorkerProfile, factor: float) -> WorkerProfile:
    """``profile`` with every compute time times ``factor`` (a smaller model on the same device)."""
    times = ("prefill_base_s", "prefill_per_token_s", "prefill_per_token_context_s", "decode_base_s",
             "decode_per_seq_s", "decode_per_seq_context_s")
    return dataclasses.replace(profile, name=f"{profile.name}x{factor:g}",
                               **{t: getattr(profile, t) * factor for t in times})


@dataclasses.dataclass(frozen=True)
class Tier:
    prefill_s: float  # one prompt's prefill
    step_s: float  # one decode step of the batch (what a request waits per token)
    share_s: float  # a request's share of that step (what it costs)

    @classmethod
    def of(cls, profile: WorkerProfile, prompt: int, output: int, batch: int) -> "Tier":
        step = profile.decode_step_s(batch, batch * (prompt + output / 2))
        return cls(profile.prefill_s(prompt, prompt), step, step / batch)


def pgr_routellm(f: float) -> float:
    return 1 - (1 - f) ** ROUTELLM_EXPONENT


def evaluate(small: Tier, large: Tier, confidences: list[tuple[str, float]], threshold: float, tokens: int,
             output: int) -> dict:
    """One threshold's row: escalated share (all, easy, hard), cost, latency and quality."""
    escalated = [(kind, c < threshold) for kind, c in confidences]
    f = sum(e for _, e in escalated) / len(escalated)
    by_kind = {k: [e for kind, e in escalated if kind == k] for k in ("easy", "hard")}
    probe_s = small.prefill_s + tokens * small.share_s
    cost = {False: small.prefill_s + output * small.share_s, True: probe_s + large.prefill_s + output * large.share_s}
    small_wait = small.prefill_s + min(tokens, output) * small.step_s  # the first tokens are held this long
    ttft = {False: small_wait, True: small_wait + large.prefill_s + large.step_s}
    e2e = {False: small.prefill_s + output * small.step_s,
           True: small_wait + large.prefill_s + output * large.step_s}
    large_cost = large.prefill_s + output * large.share_s
    mean_cost = sum(cost[e] for _, e in escalated) / len(escalated)
    return {"threshold": threshold, "escalated": round(f, 4),
            "escalated_easy": round(sum(by_kind["easy"]) / max(1, len(by_kind["easy"])), 4),
            "escalated_hard": round(sum(by_kind["hard"]) / max(1, len(by_kind["hard"])), 4),
            "cost_per_request_s": round(mean_cost, 6), "cost_vs_large": round(mean_cost / large_cost, 4),
            "cost_vs_small": round(mean_cost / cost[False], 4),
            "ttft_mean_s": round(sum(ttft[e] for _, e in escalated) / len(escalated), 4),
            "e2e_mean_s": round(sum(e2e[e] for _, e in escalated) / len(escalated), 4),
            "e2e_p90_s": round(percentile([e2e[e] for _, e in escalated], 90), 4),
            "pgr_routellm": round(pgr_routellm(f), 4), "pgr_random": round(f, 4)}


def run(args) -> dict:
    data = cascade_confidence.load()
    spec = CascadeSpec(("small", "large"), args.signal, args.tokens, 0.0)
    if args.tokens > data["tokens"]:
        raise ValueError(f"--tokens {args.tokens}: the measurement kept the first {data['tokens']} tokens")
    confidences = [(row["kind"], spec.confidence(row["logprobs"])) for row in data["prompts"]]
    large_profile = load_profile(args.profile, args.calibration)
    small = Tier.of(scaled(large_profile, args.small_scale), args.prompt_tokens, args.output_tokens, args.batch)
    large = Tier.of(large_profile, args.prompt_tokens, args.output_tokens, args.batch)
    rows = [evaluate(small, large, confidences, t, args.tokens, args.output_tokens)
            for t in (-float("inf"), *args.thresholds, float("inf"))]
    alone = {name: {"ttft_s": round(t.prefill_s + t.step_s, 4), "e2e_s": round(t.prefill_s + args.output_tokens * t.step_s, 4),
                    "cost_per_request_s": round(t.prefill_s + args.output_tokens * t.share_s, 6)}
             for name, t in (("small", small), ("large", large))}
    return {"profile": args.profile, "small_scale": args.small_scale, "alone": alone, "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens, "batch": args.batch, "signal": args.signal, "tokens": args.tokens,
            "confidence": {"model": data["model"], "prompts": len(confidences),
                           "easy": sum(k == "easy" for k, _ in confidences),
                           "source": "services/sim/cascade_confidence.json (python -m services.sim.cascade_confidence)"},
            "quality_model": {"routellm": f"PGR(f) = 1 - (1 - f)^{ROUTELLM_EXPONENT:.2f}, APGR {ROUTELLM_APGR} "
                                          "(RouteLLM, arXiv:2406.18665, MT Bench, mf + GPT-4-judge augmentation)",
                              "random": "PGR(f) = f"},
            "rows": [{**r, "threshold": str(r["threshold"]) if abs(r["threshold"]) == float("inf") else r["threshold"]}
                     for r in rows]}


def print_table(result: dict) -> None:
    print(f"cascade {result['profile']} large / x{result['small_scale']} small, prompt {result['prompt_tokens']}, "
          f"output {result['output_tokens']}, batch {result['batch']}, signal {result['signal']} of the first "
          f"{result['tokens']} tokens over {result['confidence']['prompts']} measured prompts")
    for name, a in result["alone"].items():
        print(f"  {name} tier alone: TTFT {a['ttft_s']:.3f} s, e2e {a['e2e_s']:.3f} s, {a['cost_per_request_s'] * 1e3:.2f} "
              "worker-ms per request")
    print(f"{'threshold':>9} {'escal.':>7} {'easy':>6} {'hard':>6} {'cost/large':>10} {'TTFT s':>8} {'e2e s':>8} "
          f"{'e2e p90':>8} {'PGR rllm':>8} {'PGR rand':>8}")
    for r in result["rows"]:
        print(f"{r['threshold']!s:>9} {r['escalated']:>7.2f} {r['escalated_easy']:>6.2f} {r['escalated_hard']:>6.2f} "
              f"{r['cost_vs_large']:>10.3f} {r['ttft_mean_s']:>8.3f} {r['e2e_mean_s']:>8.3f} {r['e2e_p90_s']:>8.3f} "
              f"{r['pgr_routellm']:>8.3f} {r['pgr_random']:>8.3f}")


def main(args) -> int:
    result_files.report("cascade", run(args), args, print_table)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("cascade", help='model "auto": cost, latency and quality of the cascade at several thresholds',
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="h100", help="the large tier's worker profile (calibration file)")
    p.add_argument("--calibration", default=None, help="another calibration file")
    p.add_argument("--small-scale", type=float, default=0.154, help="the small tier's times over the large's")
    p.add_argument("--prompt-tokens", type=int, default=1020)
    p.add_argument("--output-tokens", type=int, default=129)
    p.add_argument("--batch", type=int, default=32, help="requests decoding together on a worker")
    p.add_argument("--signal", default="mean", choices=["mean", "min"])
    p.add_argument("--tokens", type=int, default=8, help="first tokens judged (--cascade-tokens)")
    p.add_argument("--thresholds", type=lambda s: [float(x) for x in s.split(",") if x], default=list(THRESHOLDS),
                   help="comma-separated thresholds (-inf and inf, never and always, are added)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=main)
