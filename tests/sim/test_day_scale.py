"""The compressed day: every time measured against the day is compressed with it; perfect foresight's ratio."""

import pytest

from services.planner.policy import PlannerConfig
from services.sim.day_scale import DayScale
from services.sim.experiments import diurnal_day, ideal_ratio, planner_variants
from services.sim.profiles import load_profile
from services.sim.workloads import ArrivalShape

PROFILE = load_profile("h100")


def test_a_day_compressed_48x_compresses_the_cold_start_tick_hysteresis_and_bursts_48x():
    scale = DayScale(1800)
    assert scale.k == 48
    day = scale.profile(PROFILE)
    assert (day.cold_start_s, day.warm_start_s) == (PROFILE.cold_start_s / 48, PROFILE.warm_start_s / 48)
    assert day.prefill_s(2048, 2048) == PROFILE.prefill_s(2048, 2048)  # a request's own times are not
    assert scale.tick_s == pytest.approx(10 / 48) and scale.heartbeat_s == scale.tick_s
    assert scale.burst_s == pytest.approx(2.5) and scale.hpa_window_s == pytest.approx(6.25)
    c = scale.planner(PlannerConfig(), real_cold_start_s=PROFILE.cold_start_s)
    assert (c.down_after_s, c.lookahead_s, c.trend_window_s) == pytest.approx((3.125, 2.5, 6.25))
    assert c.lag_target_s == PlannerConfig().lag_target_s  # a backlog in seconds of work is a request's time
    # the variants: the lookahead is one real cold start, compressed; the ablation has none
    variants = planner_variants(PROFILE, scale, [0.7], 0.7, ablations=True)
    assert variants["target 0.7"].lookahead_s == pytest.approx(2.5)
    assert variants["no lookahead"].lookahead_s == 0
    assert variants["no warm pool"].warm_min == 0 and variants["no warm pool"].burst_factor == 1.0


def test_the_trace_bursts_last_the_compressed_burst():
    _, arrivals = diurnal_day(0, PROFILE, 1.0, DayScale(3600), "coding")
    assert len(arrivals.bursts) == 2 and all(end - start == pytest.approx(5.0) for start, end in arrivals.bursts)


def test_perfect_foresight_is_the_mean_rate_over_the_peak():
    assert ideal_ratio(ArrivalShape(rate=2.0, duration_s=100, period_s=100)) == 1.0
    sine = ArrivalShape(rate=2.0, duration_s=100, period_s=100, diurnal_amplitude=0.82)
    assert ideal_ratio(sine) == pytest.approx(1 / 1.82, abs=0.002)
    burst = ArrivalShape(rate=2.0, duration_s=100, period_s=100, diurnal_amplitude=0.82, burst_factor=1.5,
                         bursts=[(45.0, 55.0)])  # on the peak
    # the mean gains the burst's half extra over a tenth of the day near the peak (~1.8x): 1.09
    assert ideal_ratio(burst) == pytest.approx((1 + 0.5 * 0.1 * 1.8) / (1.82 * 1.5), abs=0.01)
    # against the diurnal peak (a fleet sized without the bursts): the sine's own ratio
    assert ideal_ratio(burst, bursts=False) == pytest.approx(1 / 1.82, abs=0.002)


def test_a_day_longer_than_a_day_is_refused():
    with pytest.raises(ValueError):
        DayScale(0)
    with pytest.raises(ValueError):
        DayScale(100_000)
