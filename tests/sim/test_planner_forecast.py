"""The planner's demand forecast by time of day: learned from earlier days, read ahead instead of a trend."""

import asyncio
import dataclasses
import io
import json
import math
import random
import subprocess
import sys

import pytest
import redis as redis_lib

from services.planner.forecast import DemandForecast
from services.planner.policy import Capacity, Planner, PlannerConfig, Signals
from services.planner.service import EmitActuator, run_loop
from services.planner.signals import SignalReader
from services.registry import WORKERS_KEY, WorkerInfo, connect_redis, worker_key

CAP = Capacity(prefill_tokens_per_s=10_000, kv_blocks=1000, max_num_seqs=100)


def day(values, bins=10):
    """A recorded day: bin b's demand is values[b] tokens/s, the same number of KV blocks, no sequences."""
    return [(float(v), float(v), 0.0) for v in values[:bins]]


def test_the_forecast_is_the_median_of_the_days_so_a_burst_on_one_day_drops_out():
    quiet = [1000] * 10
    burst = [1000] * 4 + [9000] + [1000] * 5
    f = DemandForecast(period_s=100, bin_s=10, days=[day(quiet), day(burst), day(quiet)])
    assert f.peak(30, 60) == (1000, 1000, 0)
    # the next day's same hour, and a window across midnight
    assert f.expected(140, 150) == (1000, 1000, 0)
    assert f.peak(95, 105) == (1000, 1000, 0)


def test_no_forecast_where_no_day_was_recorded():
    f = DemandForecast(period_s=100, bin_s=10, days=[[None] * 5 + day([500] * 5, 5)])
    assert f.expected(0, 20) is None
    assert f.peak(60, 80) == (500, 500, 0)


def test_recording_closes_a_day_when_the_next_begins_and_survives_a_restart(tmp_path):
    f = DemandForecast(period_s=100, bin_s=50)
    f.record(10, (100, 10, 1))
    f.record(20, (300, 30, 3))
    f.record(60, (1000, 100, 10))
    assert f.days == []  # the first day is still being recorded
    path = str(tmp_path / "forecast.json")
    f.save(path)
    g = DemandForecast.load(path, 100, 50)
    g.record(110, (0, 0, 0))  # the next day: the first is added
    assert g.days == [[(200, 20, 2), (1000, 100, 10)]]
    assert g.peak(100, 199) == (1000, 100, 10)
    with pytest.raises(ValueError, match="bins of 50"):
        DemandForecast.load(path, 100, 10)
    assert DemandForecast.load(str(tmp_path / "none.json"), 100, 10).days == []


def test_only_the_last_keep_days_are_kept():
    f = DemandForecast(period_s=10, bin_s=10, keep_days=2)
    for d, v in enumerate((100, 200, 300, 400)):
        f.record(d * 10 + 1, (v, v, v))
    f.record(41, (0, 0, 0))
    assert [d[0][0] for d in f.days] == [300, 400]


def test_curves_become_a_forecast_scaled_to_the_planners_signals():
    curve = {"bin_s": 5.0, "tok_s": [10.0, 20.0, 30.0], "kv": [1.0, 2.0, 3.0]}
    f = DemandForecast.from_curves([curve, json.loads(json.dumps(curve))], tok_factor=2.0, kv_factor=0.5,
                                   period_s=15)
    assert f.peak(5, 9) == (40.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="bins differ"):
        DemandForecast.from_curves([curve, {**curve, "bin_s": 1.0}])


def signals(t, tokens_per_s, prefill):
    return Signals(now=t, prefill_workers=prefill, decode_workers=1, prefill_tokens_per_s=tokens_per_s,
                   queued_prefill_tokens=0, kv_blocks_used=0, running_seqs=0, requests_in_window=10)


def ramp_day(scale=1.0):
    # flat at 20k tokens/s for 200 s, then a step to 60k that holds: 10 s bins of a 400 s period
    return day([20_000 * scale] * 20 + [60_000 * scale] * 20, bins=40)


def run(planner, level, until=200):
    current, out = 1, {}
    for t in range(0, until, 5):
        current = planner.decide(signals(t, level, current)).prefill
        out[t] = current
    return out


def test_a_forecast_orders_workers_a_cold_start_before_the_rise_it_knows():
    config = PlannerConfig(target_utilisation=0.5, lookahead_s=30, trend_window_s=60)
    forecast = DemandForecast(period_s=400, bin_s=10, days=[ramp_day(), ramp_day()])
    plain, ahead = run(Planner(config, CAP), 20_000), run(Planner(config, CAP, forecast), 20_000)
    # flat demand: the trend sees nothing coming; the forecast sees the rise 30 s ahead (60k at 0.5: 12)
    assert plain[195] == 4
    assert ahead[150] == 4 and ahead[175] == 12


def test_the_forecast_is_scaled_to_the_day_it_sees():
    # today runs at half the recorded days' demand: the rise it orders for is half theirs
    config = PlannerConfig(target_utilisation=0.5, lookahead_s=30, trend_window_s=60)
    forecast = DemandForecast(period_s=400, bin_s=10, days=[ramp_day(2.0)])
    out = run(Planner(config, CAP, forecast), 20_000)
    assert out[150] == 4 and out[175] == 12
    # and never under the demand it sees
    low = DemandForecast(period_s=400, bin_s=10, days=[day([0] * 40, bins=40)])
    assert run(Planner(config, CAP, low), 20_000)[195] == 4


def swinging_day(planner, until=1500, burst_at=1400):
    """A demand that swings slowly about 20k tokens/s (+-7k over 300 s) with +-20% noise a window, and a burst
    of 60k for 20 s at ``burst_at``: the prefill counts decided, every 5 s."""
    rng, current, out = random.Random(0), 1, {}
    for t in range(0, until, 5):
        level = (20_000 + 7_000 * math.sin(2 * math.pi * t / 300)) * rng.uniform(0.8, 1.2)
        if burst_at <= t < burst_at + 20:
            level = 60_000
        current = planner.decide(signals(t, level, current)).prefill
        out[t] = current
    return out


def test_a_level_scaled_from_the_forecast_over_a_long_window_holds_through_the_demands_swings():
    # the forecast says 20k all day; at target 0.5 that is 4 workers. The trend window's trimmed mean follows
    # each swing (3 to 6 workers); the forecast scaled by the last 600 s's demand hardly moves
    flat = DemandForecast(period_s=4000, bin_s=10, days=[day([20_000] * 400, bins=400)])

    def planner(forecast_level_s):
        config = PlannerConfig(target_utilisation=0.5, lookahead_s=30, trend_window_s=60, down_after_s=30,
                               forecast_level_s=forecast_level_s)
        return Planner(config, CAP, flat)

    plain, scaled = swinging_day(planner(0)), swinging_day(planner(600))
    assert {v for t, v in plain.items() if 400 <= t < 1400} == {3, 4, 5, 6}
    assert {v for t, v in scaled.items() if 400 <= t < 1400} <= {4, 5}
    # a burst is still taken at once (60k at 0.5: 12 workers, on the tick after its second window)
    assert plain[1405] == scaled[1405] == 12


def test_a_forecast_level_needs_half_its_window_seen_and_a_forecast():
    flat = DemandForecast(period_s=4000, bin_s=10, days=[day([20_000] * 400, bins=400)])
    config = PlannerConfig(target_utilisation=0.5, lookahead_s=30, trend_window_s=60, forecast_level_s=600)
    # before 300 s seen (and with no forecast at all) the level is the trend window's, as without the option
    assert swinging_day(Planner(config, CAP, flat), until=300) == swinging_day(
        Planner(dataclasses.replace(config, forecast_level_s=0), CAP, flat), until=300)
    assert swinging_day(Planner(config, CAP)) == swinging_day(
        Planner(dataclasses.replace(config, forecast_level_s=0), CAP))
    with pytest.raises(ValueError, match="forecast_level_s >= 0"):
        PlannerConfig(forecast_level_s=-1)


def test_the_fixed_standby_is_kept_while_the_forecast_rises_and_let_go_on_the_way_down():
    # the recorded days rise to 60k tokens/s at 200 s and fall back to 20k by 400 s (10 s bins, 400 s period)
    hill = DemandForecast(period_s=400, bin_s=10, days=[day([20_000 + 2_000 * min(b, 40 - b) for b in range(40)],
                                                             bins=40)])

    def pools(warm_min_ahead_s):
        config = PlannerConfig(target_utilisation=0.5, lookahead_s=30, trend_window_s=60, burst_factor=1.0,
                               warm_min=1, warm_min_ahead_s=warm_min_ahead_s)
        planner, out = Planner(config, CAP, hill), {}
        for t in range(0, 400, 5):
            out[t] = planner.decide(signals(t, 20_000 + 2_000 * min(t / 10, 40 - t / 10), 4)).warm
        return out

    gated, always = pools(50), pools(0)
    assert all(always[t] >= 1 for t in always)
    assert all(gated[t] >= 1 for t in range(10, 190, 5))  # rising: the next 50 s stand over the last 50
    assert all(gated[t] == 0 for t in range(215, 400, 5))  # falling: no standby
    with pytest.raises(ValueError, match="warm_min_ahead_s must be >= 0"):
        PlannerConfig(warm_min_ahead_s=-1)


class StepClock:
    def __init__(self, t):
        self.t = t

    def __call__(self):
        return self.t


def test_the_service_records_each_days_demand_and_keeps_it_across_restarts(redis_url, tmp_path):
    """``pdserve planner --forecast-file``'s loop on a real Redis: a decode worker's KV in use is recorded at
    its time of day; once the next day starts the file holds that day, and a new planner reads it ahead."""
    r = redis_lib.Redis.from_url(redis_url)
    r.flushdb()
    info = WorkerInfo(worker_id="d0", role="decode", address="127.0.0.1:1", model="m", namespace="ns",
                      block_size=16, max_model_len=2048, ready=True, num_running=3, kv_blocks_total=1000,
                      kv_blocks_used=600)
    r.set(worker_key("d0"), info.to_json(), px=60_000)
    r.sadd(WORKERS_KEY, "d0")
    path = str(tmp_path / "forecast.json")
    clock = StepClock(3 * 86_400 + 3_600)  # 01:00 on some day

    async def tick(forecast):
        redis = await connect_redis(redis_url)
        try:
            planner = Planner(PlannerConfig(), CAP, forecast)
            reader = SignalReader(redis, model="m", clock=clock)
            await run_loop(reader, planner, EmitActuator(redis, "m", out=io.StringIO()), 0.01, 1,
                           forecast_path=path)
        finally:
            await redis.aclose()

    asyncio.run(tick(DemandForecast.load(path, 86_400, 300)))
    assert DemandForecast.load(path, 86_400, 300).days == []  # the day is still being recorded
    clock.t += 86_400  # the next day, same time: a restarted planner closes the first day
    asyncio.run(tick(DemandForecast.load(path, 86_400, 300)))
    forecast = DemandForecast.load(path, 86_400, 300)
    assert len(forecast.days) == 1
    assert forecast.peak(3_600, 3_600)[1:] == (600.0, 3.0)  # KV blocks and sequences at 01:00
    assert forecast.expected(7_200, 7_500) is None  # nothing was recorded at 02:00


def test_cli_rejects_a_bad_forecast_bin():
    proc = subprocess.run([sys.executable, "-m", "services.cli", "planner", "--forecast-bin-s", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--forecast-bin-s must be in (0, 86400]" in proc.stderr
