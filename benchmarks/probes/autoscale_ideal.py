"""Probe: perfect foresight's worker-hours against static peak provisioning on an autoscale day, as `pdserve
bench sim` computes them (``ideal_worker_hours_vs_static``: the bursts count as the peak;
``ideal_worker_hours_vs_diurnal_peak``: the diurnal peak alone), for a day whose bench run did not finish.

    PYTHONPATH=. python benchmarks/probes/autoscale_ideal.py conversation 1 --rate 32
"""

import argparse

from autoscale_day import add_day_arguments, load_day_and_arrivals

from services.sim import experiments


def main() -> None:
    ap = argparse.ArgumentParser()
    add_day_arguments(ap, rate=32.0)
    ap.add_argument("--period-s", type=float, default=7200.0)
    args = ap.parse_args()
    _, _, trace, arrivals = load_day_and_arrivals(args, args.period_s)
    print(f"{len(trace)} requests, {args.shape} day seed {args.seed}, rate {args.rate:g}: perfect foresight "
          f"{experiments.ideal_ratio(arrivals)} of static peak (bursts as the peak), "
          f"{experiments.ideal_ratio(arrivals, bursts=False)} against the diurnal peak")


if __name__ == "__main__":
    main()
