"""Where the planner's decided workers come from, per role, in worker-hours over the k = 12 day.

Each tick's decided count is split into steps of the rule (services/planner/policy.py, ``decide``):
  demand     ceil(the trend window's level / capacity at the target)  (the floor: min_prefill, min_decode)
  lookahead  the level read ahead by the trend's rise over a cold start
  lag+boost  the queue lag's backlog order and the SLO boosts (and the role's minimum)
  hold       the hysteresis: the count kept after the need fell (down_after_s, then the window's highest)
  lag unheld the queue lag's backlog order beyond the held count (``hold_lag`` False only)
Each part's worker-hours are its count times the time to the next tick. The decided counts differ from the serving ones
(a cold start; a drained worker serving its last requests), so the parts sum to the decided, not the
billed, worker-hours. Printed beside them, per tenth of the day: each role's mean parts.

Usage: PYTHONPATH=. python benchmarks/probes/autoscale_need_attribution.py coding 1 [CONFIG-JSON] [--rate 8]
``--prompt-times``: instead, the share of the day's prompts whose prefill alone (no cache hit, an idle
worker) takes over 0.5, 1 and 2 s: what a TTFT SLO of 2 s leaves for queueing.
"""

import argparse
import json
import time

from services.planner import policy
from autoscale_day import add_day_arguments, load_day

from services.planner.policy import PlannerConfig
from services.sim import experiments
from services.sim.metrics import SLO

PARTS = ("demand", "lookahead", "lag+boost", "hold", "lag unheld")


def main() -> None:
    ap = argparse.ArgumentParser()
    add_day_arguments(ap, config_help="PlannerConfig fields as JSON (target_utilisation 0.8)")
    ap.add_argument("--prompt-times", action="store_true")
    args = ap.parse_args()
    overrides = json.loads(args.config)
    profile, scale, trace = load_day(args)
    if args.prompt_times:
        times = [profile.prefill_s(r.num_tokens, r.num_tokens) for r in trace]
        print(f"{args.shape} seed {args.seed} rate {args.rate}: {len(times)} prompts; uncached prefill over "
              + ", ".join(f"{lim} s: {sum(t > lim for t in times) / len(times):.4f}" for lim in (0.5, 1.0, 2.0)))
        return
    config = scale.planner(PlannerConfig(**{"target_utilisation": 0.8, **overrides}), profile.cold_start_s)
    ticks: list[dict] = []  # per tick: t, and per role its parts
    state: dict = {}
    ahead_of, hysteresis_of, decide_of = policy.Planner._ahead, policy.Planner._hysteresis, policy.Planner.decide

    def ahead(self, s):
        level, ahead_, likely = ahead_of(self, s)
        c, cap = self.config, self.capacity
        for name, demand in (("level", level), ("ahead", ahead_)):
            p = demand[0] / (cap.prefill_tokens_per_s * c.target_utilisation)
            state[name] = {"prefill": 0 if p < c.local_prefill_below else -(-p // 1),
                           "decode": max(-(-demand[1] // (cap.kv_blocks * c.kv_target)),
                                         -(-demand[2] // (cap.max_num_seqs * c.target_utilisation)))}
        return level, ahead_, likely

    def hysteresis(self, role, now, current, need):
        out = hysteresis_of(self, role, now, current, need)
        state.setdefault("pre", {})[role], state.setdefault("final", {})[role] = need, out
        return out

    def decide(self, s):
        state.clear()
        d = decide_of(self, s)
        if "level" in state:
            row = {"t": s.now}
            for role in ("prefill", "decode"):
                base, ahead_n = state["level"][role], max(state["ahead"][role], state["level"][role])
                pre, final = state["pre"][role], state["final"][role]
                row[role] = {"demand": base, "lookahead": ahead_n - base, "lag+boost": pre - ahead_n,
                             "hold": final - pre, "lag unheld": getattr(d, role) - final}
            ticks.append(row)
        return d

    policy.Planner._ahead, policy.Planner._hysteresis, policy.Planner.decide = ahead, hysteresis, decide
    started = time.time()
    run = experiments._autoscaled(scale.profile(profile), trace, SLO(2.0, 0.05), scale, "planner", config)
    print(f"{args.shape} seed {args.seed} rate {args.rate} {overrides}: attainment {run['slo_attainment']}, "
          f"{run['worker_hours']} worker-h, peak {run['peak']}, wall {time.time() - started:.0f} s")
    print("  by state", run["worker_hours_by_state"])
    for a, b in zip(ticks, ticks[1:] + [{"t": scale.period_s}]):
        a["h"] = (b["t"] - a["t"]) / 3600
    for role in ("prefill", "decode"):
        print(f"  {role}: " + ", ".join(f"{p} {sum(t[role][p] * t['h'] for t in ticks):.3f}" for p in PARTS)
              + " worker-h (decided)")
    span = scale.period_s / 10
    print(f"{'from s':>7}" + "".join(f"{r[0] + '.' + p[:5]:>8}" for r in ("prefill", "decode") for p in PARTS))
    for b in range(10):
        ts = [t for t in ticks if b * span <= t["t"] < (b + 1) * span]
        if ts:
            print(f"{b * span:>7.0f}" + "".join(f"{sum(t[r][p] for t in ts) / len(ts):>8.2f}"
                                               for r in ("prefill", "decode") for p in PARTS))


if __name__ == "__main__":
    main()
