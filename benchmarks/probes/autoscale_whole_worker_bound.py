"""Probe: the least worker-hours a controller could run on an autoscale day if no worker is ever loaded past what
static's minimum holds at the day's peak, from the day's demand curve alone (no simulation, seconds).

Each role's count follows the day: static's count (``P+D``) times the demand over the day's peak demand, the
demand a moving mean over ``--window-s`` and the peak its highest outside the bursts (static holds the bursts by
queueing: the twenty-seventh session's 10+7 met both at 1.0). Printed per window: the fractional worker-hours
(workers that come in any fraction, started the instant they are needed) and the whole workers' (each count
rounded up), and both over static's worker-hours. A controller at least as careful as static's peak pays at
least the whole workers' figure, before any cold start, standby or reaction lag.

The curves are ``autoscale_demand_curve.py``'s (prompt tokens to compute a second, KV blocks held); the tokens
are read for prefill and the KV blocks for decode.

    PYTHONPATH=. python benchmarks/probes/autoscale_whole_worker_bound.py curve-seed1.json 10+7 \
        [--window-s 60 300 900]
"""

import argparse
import json
import math


def moving_mean(xs: list[float], n: int) -> list[float]:
    """The mean of each bin and the ``n - 1`` before it (fewer at the day's start)."""
    out, total = [], 0.0
    for i, x in enumerate(xs):
        total += x
        if i >= n:
            total -= xs[i - n]
        out.append(total / min(i + 1, n))
    return out


def bound(demand: list[float], static: int, bin_s: float, window_s: float, in_burst: list[bool]) -> tuple:
    smooth = moving_mean(demand, max(1, round(window_s / bin_s)))
    peak = max(d for d, b in zip(smooth, in_burst) if not b)
    need = [static * d / peak for d in smooth]
    hours = bin_s / 3600
    return sum(need) * hours, sum(max(1, math.ceil(n - 1e-9)) for n in need) * hours


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("curve", help="autoscale_demand_curve.py's output for the day")
    ap.add_argument("static", help="static's minimum, PREFILL+DECODE (e.g. 10+7)")
    ap.add_argument("--window-s", type=float, nargs="+", default=[60.0, 300.0, 900.0],
                    help="the moving mean's windows, in simulated seconds")
    args = ap.parse_args()
    try:
        prefill, decode = (int(x) for x in args.static.split("+"))
    except ValueError:
        ap.error(f"static must be PREFILL+DECODE, like 10+7; got {args.static!r}")
    curve = json.load(open(args.curve))
    bin_s = curve["bin_s"]
    n = len(curve["tok_s"])
    day_h = n * bin_s / 3600
    static_h = (prefill + decode) * day_h
    print(f"{curve['shape']} seed {curve['seed']} rate {curve['rate']:g} {curve['profile']}: static {args.static} "
          f"over {day_h:.3f} h = {static_h:.3f} worker-h")
    for w in args.window_s:
        # a burst's bins, and this window's worth after it (the moving mean carries it that long)
        in_burst = [any(a <= i * bin_s < b + w for a, b in curve["bursts"]) for i in range(n)]
        pf, pw = bound(curve["tok_s"], prefill, bin_s, w, in_burst)
        df, dw = bound(curve["kv"], decode, bin_s, w, in_burst)
        print(f"  window {w:5.0f} s: fractional {pf:6.3f} + {df:6.3f} = {pf + df:6.3f} worker-h "
              f"({(pf + df) / static_h:.3f} of static); whole workers {pw:6.3f} + {dw:6.3f} = {pw + dw:6.3f} "
              f"({(pw + dw) / static_h:.3f})")


if __name__ == "__main__":
    main()
