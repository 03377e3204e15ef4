"""The autoscaling planner's decisions on small crafted signal traces."""

import random

import pytest

from services.planner.policy import (
    Capacity,
    Planner,
    PlannerConfig,
    Signals,
    ThresholdRule,
)

CAP = Capacity(prefill_tokens_per_s=10_000, kv_blocks=1000, max_num_seqs=100)


def signals(t, prefill=2, decode=2, tokens_per_s=0.0, queued=0.0, kv=0, running=0, ttft=None, itl=None, reqs=10,
            prefill_starting=0):
    return Signals(now=t, prefill_workers=prefill, decode_workers=decode, prefill_tokens_per_s=tokens_per_s,
                   queued_prefill_tokens=queued, kv_blocks_used=kv, running_seqs=running, ttft_attainment=ttft,
                   itl_attainment=itl, requests_in_window=reqs, prefill_starting=prefill_starting)


def planner(**config):
    return Planner(PlannerConfig(**config), CAP)


def test_demand_sets_the_counts():
    p = planner(target_utilisation=0.5, kv_target=0.5)
    d = p.decide(signals(0, tokens_per_s=42_000, kv=2600, running=120))
    assert (d.prefill, d.decode) == (9, 6)  # 42k / (10k * 0.5) -> 9; 2600 / (1000 * 0.5) -> 6 beats 120 / 50 -> 3


def test_queue_lag_adds_prefill_workers_at_once():
    p = planner()
    # 100,000 tokens queued: 5 s of the 2 workers' work, 10 s of one's; clearing it within lag_target_s
    # (1 s) takes 10 more
    d = p.decide(signals(0, prefill=2, tokens_per_s=1000, queued=100_000))
    assert d.prefill == 2 + 10 and "queue lag" in d.reason
    # with lookahead_s (a cold start) the backlog is cleared over it: the workers ordered now serve then
    d = planner(lookahead_s=10).decide(signals(0, prefill=2, tokens_per_s=1000, queued=100_000))
    assert d.prefill == 2 + 1


def test_missed_slos_add_headroom():
    d = planner(boost=1.5).decide(signals(0, prefill=4, decode=4, tokens_per_s=1000, ttft=0.9, itl=0.95, reqs=50))
    assert (d.prefill, d.decode) == (6, 6)
    assert "TTFT" in d.reason and "ITL" in d.reason


def test_a_window_of_few_requests_is_not_judged_on_its_slos():
    # 10 requests, one slow: 90% is noise, not a reason to add workers
    d = planner(boost=1.5, slo_min_requests=20).decide(signals(0, prefill=4, decode=4, tokens_per_s=1000,
                                                               ttft=0.9, itl=0.9, reqs=10))
    assert (d.prefill, d.decode) == (4, 4) and "attainment" not in d.reason


def test_scale_down_waits_then_steps():
    p = planner(down_after_s=300, down_step=0.25)
    # 20 prefill workers, demand for 2: held for 300 s, then 25% per decision
    counts = []
    current = 20
    for t in range(0, 1500, 50):
        d = p.decide(signals(t, prefill=current, decode=1, tokens_per_s=12_000))
        counts.append(d.prefill)
        current = d.prefill
    assert counts[:6] == [20] * 6  # t = 0 .. 250
    assert counts[6:9] == [15, 12, 9]  # t = 300, 350, 400
    assert counts[-1] == 2


def test_the_default_hold_releases_a_burst_after_150_s_not_300():
    # the default hysteresis is a little over one cold start (150 s): at 300 it held a day's falls for
    # 3.9 of the planner's 36.4 worker-h (k = 12, 32 starts/s, target 0.6). trend_window_s 20: each
    # window's demand is its need (the filter is tested apart)
    p = planner(trend_window_s=20, down_step=1.0)
    current = p.decide(signals(0, prefill=1, tokens_per_s=60_000)).prefill  # 60k / (10k x 0.6): 10
    assert current == 10
    counts = {}
    for t in range(10, 320, 10):  # back to 6,000 tokens/s: 1 worker
        current = p.decide(signals(t, prefill=current, tokens_per_s=6_000)).prefill
        counts[t] = current
    assert counts[150] == 10  # held while the fall is under 150 s old
    assert counts[160] == 1  # released at 150 s (the old 300 s held 10 until t = 310)


def test_a_burst_resets_the_scale_down_clock():
    p = planner(down_after_s=300)
    p.decide(signals(0, prefill=10, tokens_per_s=1000))
    p.decide(signals(200, prefill=10, tokens_per_s=60_000))  # demand back above the count
    assert p.decide(signals(400, prefill=10, tokens_per_s=1000)).prefill == 10  # 200 s below, not 300


def test_warm_pool_follows_the_active_count():
    # no burst to size the pool (burst_factor 1): the share of the actives is what it keeps
    d = planner(warm_fraction=0.2, warm_min=1, burst_factor=1.0).decide(signals(0, tokens_per_s=60_000, kv=9000))
    assert d.warm == round(0.2 * (d.prefill + d.decode) + 0.49)
    assert planner(warm_fraction=0.0, warm_min=2).decide(signals(0)).warm == 2


def test_idle_model_scales_to_zero_and_comes_back():
    p = planner(idle_to_zero_s=600, warm_min=1)
    p.decide(signals(0, tokens_per_s=5000))
    assert p.decide(signals(300, reqs=0)).prefill == 1  # idle, not for long enough
    d = p.decide(signals(700, reqs=0))
    assert (d.prefill, d.decode, d.warm) == (0, 0, 1) and "zero" in d.reason
    d = p.decide(signals(710, prefill=0, decode=0, queued=5000, reqs=3))  # a request arrives
    assert d.decode >= 1  # it prefills the prompt itself: half a second of one prefill worker's work


def test_threshold_rule_is_an_hpa():
    rule = ThresholdRule(target=0.5, down_after_s=300)
    assert rule.desired("decode", 0, 4, 1.0) == 8
    assert rule.desired("decode", 100, 8, 0.1) == 8  # the window still holds the 8
    assert rule.desired("decode", 401, 8, 0.1) == 2


def test_bad_planner_config_is_refused():
    with pytest.raises(ValueError):
        PlannerConfig(target_utilisation=0)
    with pytest.raises(ValueError):
        PlannerConfig(boost=0.5)
    with pytest.raises(ValueError):
        Capacity(0, 1, 1)


def test_idle_time_counts_from_the_first_decision():
    """A live planner's clock is the host's (large at start): no traffic yet is not idle yet."""
    p = planner(idle_to_zero_s=600)
    assert p.decide(signals(50_000, reqs=0)).decode >= 1
    assert p.decide(signals(50_599, reqs=0)).decode >= 1
    assert p.decide(signals(50_600, reqs=0)).decode == 0


def test_rising_demand_is_read_a_cold_start_ahead():
    # prefill demand climbs 100 tokens/s every second: 120 s ahead it is 12,000 tokens/s more
    p = planner(target_utilisation=0.5, lookahead_s=120, trend_window_s=60)
    for t in range(0, 60, 10):
        d = p.decide(signals(t, prefill=2, tokens_per_s=10_000 + 100 * t))
    # now 15,000 (3 workers at 50%); ahead 27,000 (6)
    assert d.prefill == 6 and "rising demand" in d.reason
    flat = planner(target_utilisation=0.5, lookahead_s=120, trend_window_s=60)
    for t in range(0, 60, 10):
        d = flat.decide(signals(t, prefill=2, tokens_per_s=15_000))
    assert d.prefill == 3 and "rising" not in d.reason


def test_one_noisy_window_is_not_a_trend():
    # the second window alone doubles: with under half a trend window of history nothing is read ahead
    p = planner(target_utilisation=0.5, lookahead_s=120, trend_window_s=120)
    p.decide(signals(0, tokens_per_s=5_000))
    assert p.decide(signals(10, tokens_per_s=10_000)).prefill == 2


def test_the_slo_boost_waits_for_the_last_one_to_start():
    # misses on every 10 s tick: one boost per 30 s, not 1.25 ** n compounding while workers start
    p = planner(boost=1.25, boost_every_s=30)
    counts, current = [], 8
    for t in range(0, 60, 10):
        current = p.decide(signals(t, prefill=current, tokens_per_s=1000, ttft=0.5, reqs=50)).prefill
        counts.append(current)
    assert counts == [10, 10, 10, 13, 13, 13]


def test_missed_ttfts_with_decode_kv_full_add_decode_workers():
    p = planner(boost=1.5, kv_target=0.7)
    d = p.decide(signals(0, prefill=4, decode=4, tokens_per_s=1000, kv=2900, ttft=0.8, reqs=50))
    assert d.decode == 6 and "KV at target" in d.reason  # 2,900 of 4 x 1,000 blocks: over 70%
    d = planner(boost=1.5, kv_target=0.7).decide(signals(0, prefill=4, decode=4, tokens_per_s=1000, kv=1000,
                                                         ttft=0.8, reqs=50))
    assert d.decode == 4  # KV has room: the misses are the prefill's


def test_workers_still_starting_are_not_ordered_again_for_the_same_backlog():
    # 100,000 tokens queued on 2 ready workers: 10 more clear it in lag_target_s (1 s)
    p = planner()
    assert p.decide(signals(0, prefill=2, tokens_per_s=1000, queued=100_000)).prefill == 12
    # next tick those 10 are still starting and the backlog is the same: nothing more is ordered
    # (the old rule added 10 on every tick of a cold start: a burst once ordered 30 workers)
    d = p.decide(signals(10, prefill=12, tokens_per_s=1000, queued=100_000, prefill_starting=10))
    assert d.prefill == 12
    # the backlog grew by half: only the workers beyond those starting
    d = p.decide(signals(20, prefill=12, tokens_per_s=1000, queued=150_000, prefill_starting=10))
    assert d.prefill == 2 + 15


def test_no_slo_boost_while_the_last_ordered_workers_start():
    p = planner(boost=1.5, boost_every_s=0)
    d = p.decide(signals(0, prefill=4, tokens_per_s=1000, ttft=0.9, reqs=50, prefill_starting=2))
    assert d.prefill == 4  # the misses are from before those 2 serve
    assert p.decide(signals(10, prefill=4, tokens_per_s=1000, ttft=0.9, reqs=50)).prefill == 6


def test_the_warm_pool_covers_the_burst_the_slo_must_survive():
    # 60,000 tokens/s at target 0.8: 8 prefill workers; a 1.5x burst served at 90% needs 10: 2 warm.
    # 3,000 KV blocks at kv_target 0.75: 4 decode workers; 4,500 in the burst held to burst_kv_target 0.7 (the
    # default) need 7: 3 warm
    p = planner(target_utilisation=0.8, kv_target=0.75, burst_factor=1.5, burst_utilisation=0.9, warm_min=1)
    d = p.decide(signals(0, tokens_per_s=60_000, kv=3000))
    assert (d.prefill, d.decode, d.warm) == (8, 4, 2 + 3)
    # burst_kv_target 0: decode's KV in the burst at burst_utilisation 0.9 too: 5 workers, 1 warm
    d = planner(target_utilisation=0.8, kv_target=0.75, burst_kv_target=0).decide(signals(0, tokens_per_s=60_000,
                                                                                        kv=3000))
    assert (d.prefill, d.decode, d.warm) == (8, 4, 2 + 1)
    # twice the demand: 20 - 15 and 10 - 8 (the pool follows the burst's need, not a share of the actives)
    d = planner(target_utilisation=0.8, kv_target=0.75, burst_kv_target=0).decide(signals(0, tokens_per_s=120_000,
                                                                                        kv=6000))
    assert (d.prefill, d.decode, d.warm) == (15, 8, 7)
    # no burst to survive: warm_min only
    assert planner(burst_factor=1.0, warm_min=1).decide(signals(0, tokens_per_s=60_000, kv=3000)).warm == 1


def test_after_a_burst_the_count_falls_to_the_last_windows_need_at_once():
    # trend_window_s 20 s: two 10 s windows, too few to filter, so each window's demand is its need (the
    # filter is tested apart)
    p = planner(down_after_s=60, down_step=1.0, target_utilisation=0.5, trend_window_s=20)
    current = p.decide(signals(0, prefill=2, tokens_per_s=10_000)).prefill  # 2
    current = p.decide(signals(10, prefill=current, tokens_per_s=100_000)).prefill  # the burst: 20
    assert current == 20
    counts = {}
    for t in range(20, 160, 10):  # back to 10,000 tokens/s (2 workers), with a smaller rise at 50-60 s (12)
        demand = 60_000 if t in (50, 60) else 10_000
        current = p.decide(signals(t, prefill=current, tokens_per_s=demand)).prefill
        counts[t] = current
    assert all(counts[t] == 20 for t in range(20, 80, 10))  # held for down_after_s after the burst
    assert counts[80] == 12  # then at once to the highest need of the last window (the rise), not to 2
    assert counts[150] == 2  # and to 2 once the rise is a window old


def test_one_noisy_window_in_a_long_history_orders_nothing():
    p = planner(target_utilisation=0.5, trend_window_s=60, lookahead_s=30)
    for t in range(0, 60, 5):
        d = p.decide(signals(t, prefill=2, tokens_per_s=10_000))
    # one window of 5x (prompts counted as they finish come in clumps): the trimmed mean drops it
    d = p.decide(signals(60, prefill=d.prefill, tokens_per_s=50_000))
    assert d.prefill == 2


def test_a_steady_noisy_demand_is_served_near_its_mean_not_its_noise_peaks():
    # 20,000 tokens/s on average (4 workers at 50%), each window's count log-normally noisy (sigma 0.6, as
    # prompts counted as they finish are at short windows); the hysteresis floor is the highest need of its
    # window, so a level that follows the noise is held at its peaks
    rng = random.Random(0)
    p = planner(target_utilisation=0.5, trend_window_s=120, lookahead_s=120, down_after_s=300, down_step=0.25)
    current, counts = 1, []
    for t in range(0, 3600, 10):
        demand = 20_000 * rng.lognormvariate(-0.18, 0.6)  # mean exp(-0.18 + 0.18) = 1
        current = p.decide(signals(t, prefill=current, tokens_per_s=demand)).prefill
        counts.append(current)
    settled = counts[60:]
    # 4 workers serve the mean; the old rule (median of the last three windows, the raw slope) ran 9.5 on
    # average and 15 at most, the trimmed mean 6.1 and 10
    assert max(settled) <= 10 and sum(settled) / len(settled) <= 6.5



def test_a_trough_under_half_a_prefill_worker_runs_none_the_decode_workers_prefill_it():
    # 2,500 tokens/s against 10,000 at target 0.6: 0.42 of a prefill worker. The router prefills on the decode
    # worker when no prefill worker is registered; the old rule kept one (min_prefill 1) at ~0.4 of its capacity
    assert planner(down_after_s=0, local_prefill_below=0.5).decide(signals(0, prefill=1, decode=1, tokens_per_s=2_500)).prefill == 0
    assert planner(down_after_s=0, local_prefill_below=0.5).decide(signals(0, prefill=1, decode=1, tokens_per_s=3_500)).prefill == 1  # 0.58
    assert planner(down_after_s=0, local_prefill_below=0).decide(
        signals(0, prefill=1, decode=1, tokens_per_s=2_500)).prefill == 1


def test_missed_ttfts_with_no_prefill_worker_order_one():
    # a boost by a factor of 0 workers is 0: the decode workers prefilling locally miss, and one is ordered
    d = planner(boost=1.25, min_prefill=0).decide(signals(0, prefill=0, decode=1, ttft=0.9, reqs=50))
    assert d.prefill == 1 and "TTFT" in d.reason


def test_no_warm_standby_at_a_steady_trough():
    # a steady demand well inside the one decode worker's headroom, even 1.5x: nothing stands by (the old
    # rule's warm_min kept one, a third of the trough's workers)
    p = planner(lookahead_s=120, trend_window_s=60, warm_min=0, local_prefill_below=0.5)
    for t in range(0, 120, 10):
        d = p.decide(signals(t, prefill=0, decode=1, tokens_per_s=1_000, kv=100, running=5))
    assert (d.prefill, d.decode, d.warm) == (0, 1, 0)


def test_the_warm_pool_covers_a_noisy_ramps_rise_over_a_cold_start():
    # prefill demand climbs 200 tokens/s a second with +-4,000 of noise per window: the cold orders follow
    # the slope's lower bound, and the standbys cover the rest of what its fitted slope brings in a cold
    # start; with no burst to survive (burst_factor 1) the old rule kept none
    p = planner(target_utilisation=0.9, lookahead_s=120, trend_window_s=60, burst_factor=1.0, warm_min=0)
    current = 2
    for t in range(0, 70, 5):
        d = p.decide(signals(t, prefill=current, tokens_per_s=10_000 + 200 * t + (4_000 if t % 10 else -4_000)))
        current = d.prefill
    # at 65 s the slope's lower bound reads ~11,000 tokens/s more a cold start ahead (the cold orders), the
    # fitted slope ~30,000 more: 6 prefill workers at 90%
    assert d.warm >= 1 and d.prefill + d.warm >= 6
    flat = planner(target_utilisation=0.9, lookahead_s=120, trend_window_s=60, burst_factor=1.0, warm_min=0)
    for t in range(0, 70, 5):
        d = flat.decide(signals(t, prefill=2, tokens_per_s=10_000 + (4_000 if t % 10 else -4_000)))
    assert d.warm == 0


def test_one_late_request_in_a_window_is_noise_a_sustained_miss_is_not():
    # 50 requests a 10 s window, one late in every fourth: 0.995 over the SLO window, above the 0.99 target.
    # Judged window by window (the old rule) each such window (0.98) boosted the prefill workers
    p = planner(boost=1.5, boost_every_s=0, slo_window_s=120, down_after_s=300)  # held at 4 all the while
    for t in range(0, 240, 10):
        d = p.decide(signals(t, prefill=4, tokens_per_s=1000, ttft=0.98 if t % 40 == 0 else 1.0, reqs=50))
        assert d.prefill == 4 and "TTFT" not in d.reason
    # 0.96 window after window: 2 late of 50 is within the noise of one window (0.5 allowed + 2 sigma), 4 of
    # 100 is not
    p = planner(boost=1.5, boost_every_s=0, slo_window_s=120)
    counts = [p.decide(signals(t, prefill=4, tokens_per_s=1000, ttft=0.96, reqs=50)).prefill for t in (0, 10)]
    assert counts == [4, 6]


def test_the_default_trend_window_holds_less_of_a_steady_demands_noise():
    # the steady noisy demand above (4 workers serve its mean) under the default trend window (300 s): 5.7 on
    # average; the old default (120 s) ran 6.1. On the simulated day the same change took target 0.8 from 0.997x
    # to 0.935x static's worker-hours (coding seed 1, k = 12)
    rng = random.Random(0)
    p = planner(target_utilisation=0.5, lookahead_s=120, down_after_s=300, down_step=0.25)
    current, counts = 1, []
    for t in range(0, 3600, 10):
        current = p.decide(signals(t, prefill=current, tokens_per_s=20_000 * rng.lognormvariate(-0.18, 0.6))).prefill
        counts.append(current)
    settled = counts[60:]
    assert sum(settled) / len(settled) <= 5.8


def test_a_scale_down_goes_to_a_quantile_of_the_windows_needs_not_its_one_spike():
    # 20 workers held; over the next down_after_s the need is 2 on every tick but one, which needed 12 (one
    # noisy window). The highest need of the window (the old floor) would hold 12; its 0.8 quantile is 2
    def run(quantile):
        p = planner(down_after_s=100, down_step=1.0, target_utilisation=0.5, trend_window_s=20,
                    down_floor_quantile=quantile)
        current = p.decide(signals(0, prefill=20, tokens_per_s=100_000)).prefill
        for t in range(10, 130, 10):
            demand = 60_000 if t == 60 else 10_000
            current = p.decide(signals(t, prefill=current, tokens_per_s=demand)).prefill
        return current

    assert run(1.0) == 12  # the highest need of the window: the old rule
    assert run(0.8) == 2
    with pytest.raises(ValueError):
        PlannerConfig(down_floor_quantile=0)


def test_a_boost_waits_for_misses_still_happening_when_asked():
    # the SLO window still holds a backlog's misses (120 s of them) after the backlog was cleared: with
    # boost_only_while_missing, no boost while the queue is short and the last window met the SLO
    def run(**config):
        p = planner(boost=1.5, boost_every_s=0, **config)
        # the backlog, with workers still starting (no boost yet: the misses stay in the window)
        p.decide(signals(0, prefill=4, tokens_per_s=1000, ttft=0.5, reqs=50, queued=100_000, prefill_starting=2))
        return p.decide(signals(10, prefill=4, tokens_per_s=1000, ttft=1.0, reqs=50)).prefill
    assert run() == 6  # the default: the window's misses boost 4 -> 6
    assert run(boost_only_while_missing=True) == 4
    # still missing now (the last window under the target): boosted either way
    p = planner(boost=1.5, boost_every_s=0, boost_only_while_missing=True)
    p.decide(signals(0, prefill=4, tokens_per_s=1000, ttft=0.5, reqs=50))
    assert p.decide(signals(10, prefill=4, tokens_per_s=1000, ttft=0.9, reqs=50)).prefill == 6


def test_scale_downs_are_spaced_by_down_every_s():
    # 20 workers, demand for 2, one worker a step (down_step small), after the 150 s hold: every tick
    # without spacing, every third tick (30 s) with it
    def counts(**config):
        p, current, out = planner(down_step=0.01, **config), 20, []
        for t in range(0, 260, 10):
            current = p.decide(signals(t, prefill=current, decode=1, tokens_per_s=12_000)).prefill
            out.append(current)
        return out[15:]  # from t = 150
    assert counts() == [19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9]
    assert counts(down_every_s=30) == [19, 19, 19, 18, 18, 18, 17, 17, 17, 16, 16]
    with pytest.raises(ValueError, match="down_every_s"):
        PlannerConfig(down_every_s=-1)


def test_square_root_staffing_runs_a_larger_pool_hotter():
    # offered loads of 1, 4 and 16 workers: a + sqrt(a) is 2, 6 and 20 workers (utilisation 0.5, 0.67, 0.8)
    # where the fixed target 0.6 runs 2, 7 and 27
    for load, fixed, staffed in ((1, 2, 2), (4, 7, 6), (16, 27, 20)):
        tokens = load * CAP.prefill_tokens_per_s
        assert planner().decide(signals(0, tokens_per_s=tokens)).prefill == fixed
        assert planner(staffing_beta=1.0).decide(signals(0, tokens_per_s=tokens)).prefill == staffed
    # decode's KV alike with kv_staffing_beta (9 workers' blocks in use: 9 + 3), and the sequence count
    # still bounds it (its rule is unchanged)
    assert planner().decide(signals(0, kv=9000)).decode == 13  # 9000 / (1000 * 0.7)
    assert planner(kv_staffing_beta=1.0).decide(signals(0, kv=9000)).decode == 12
    assert planner(kv_staffing_beta=1.0).decide(signals(0, kv=9000, running=1500)).decode == 25  # 1500 / 60
    # no demand, no workers: sqrt(0) adds none
    assert planner(staffing_beta=1.0).decide(signals(0, prefill=0, tokens_per_s=0.0)).prefill == 0
    with pytest.raises(ValueError, match="staffing_beta"):
        PlannerConfig(staffing_beta=-1)


def test_a_warm_pool_rise_is_taken_once_it_held_for_warm_confirm_s():
    # a steady 60,000 tokens/s with one spike window of 120,000: the burst part of the pool (sized on the last
    # window) jumps for that one tick. Without confirmation the pool follows it, and the standbys ordered then
    # are released a tick later, still loading; with warm_confirm_s 30 the spike orders none
    def pools(**config):
        p = planner(target_utilisation=0.8, kv_target=0.75, **config)
        demand = [60_000] * 6 + [120_000] + [60_000] * 6
        return [p.decide(signals(10 * i, prefill=8, decode=4, tokens_per_s=x, kv=3000)).warm
                for i, x in enumerate(demand)]

    flicker = pools()
    assert max(flicker) > flicker[0] == flicker[-1]  # up for the spike's tick, down the next
    assert pools(warm_confirm_s=30) == [flicker[0]] * 13
    # a rise that holds: taken once it held 30 s, and a fall at once
    p = planner(target_utilisation=0.8, kv_target=0.75, warm_confirm_s=30)
    demand = [60_000] * 3 + [120_000] * 6 + [60_000] * 2
    seen = [p.decide(signals(10 * i, prefill=8, decode=4, tokens_per_s=x, kv=3000)).warm
            for i, x in enumerate(demand)]
    assert seen[3:6] == [seen[0]] * 3 and seen[6] > seen[0]  # the rise at 30 s of it (t = 60)
    assert seen[-1] == seen[0]  # the fall at once


def test_warm_confirm_s_must_not_be_negative():
    with pytest.raises(ValueError, match="warm_confirm_s"):
        PlannerConfig(warm_confirm_s=-1)


def test_up_margin_holds_a_need_just_over_the_workers_running():
    # target 0.5 at 10,000 tokens/s a worker: 15,500 tokens/s need 3.1 prefill workers; 3,100 KV blocks at
    # kv_target 0.5 need 6.2 decode workers of 1000 blocks
    def counts(tokens, kv, **config):
        d = planner(target_utilisation=0.5, kv_target=0.5, **config).decide(
            signals(0, prefill=3, decode=6, tokens_per_s=tokens, kv=kv))
        return d.prefill, d.decode

    assert counts(15_500, 3_100) == (4, 7)  # at once: 3.1 -> 4, 6.2 -> 7
    assert counts(15_500, 3_100, up_margin=0.25) == (3, 6)  # within the margin: the running 3 and 6 stay
    assert counts(17_500, 3_200, up_margin=0.25) == (4, 7)  # 3.5 and 6.4 stand over it: up
    # a role at 0 starts its first worker at once
    d = planner(target_utilisation=0.5, up_margin=0.5).decide(signals(0, prefill=0, tokens_per_s=1_000))
    assert d.prefill == 1
    # a need under the running count goes down as before (no hysteresis here): 1.0 and 2.0
    assert counts(5_000, 1_000, up_margin=0.5, down_after_s=0, down_step=1.0) == (1, 2)


def test_up_margin_does_not_hold_back_the_queue_lag_or_a_missed_slo():
    p = planner(target_utilisation=0.5, up_margin=0.9)
    # the demand's need is 3.1 (held at 3), but 90,000 tokens are queued at 10,000 a second: the lag scales up
    d = p.decide(signals(0, prefill=3, tokens_per_s=15_500, queued=90_000))
    assert d.prefill > 3 and "queue lag" in d.reason
    p = planner(target_utilisation=0.5, up_margin=0.9)
    d = p.decide(signals(0, prefill=3, tokens_per_s=15_500, ttft=0.5, reqs=100))
    assert d.prefill == 4 and "TTFT attainment" in d.reason  # the boost: 3 x 1.25 -> 4
    with pytest.raises(ValueError, match="up_margin"):
        PlannerConfig(up_margin=1.0)


def test_seq_target_sizes_decode_by_its_own_share_of_the_slots():
    # 240 running sequences at 100 slots a worker: target 0.6 runs 4 decode workers (240 / 60), seq_target 0.8
    # runs 3 (240 / 80); the KV blocks still bound it (2,400 blocks at kv_target 0.7: 4)
    def decode(kv=0, **config):
        return planner(target_utilisation=0.6, **config).decide(signals(0, kv=kv, running=240)).decode

    assert decode() == 4
    assert decode(seq_target=0.8) == 3
    assert decode(kv=2_400, seq_target=0.8) == 4
    with pytest.raises(ValueError, match="seq_target"):
        PlannerConfig(seq_target=1.5)


def test_trend_autocorrelation_reads_a_slow_swing_as_no_rise():
    # a stationary demand (no trend) whose windows swing slowly: AR(1) with rho 0.8 about 60,000 tokens/s, one
    # window every 10 s. Taken as independent windows, its swings read as rises (the lookahead then orders
    # workers a cold start ahead); with their autocorrelation in the slope's standard error, far fewer do
    def rising_ticks(**config):
        rng, x, n = random.Random(7), 0.0, 0
        p = planner(target_utilisation=0.5, lookahead_s=120, trend_window_s=300, **config)
        for i in range(600):
            x = 0.8 * x + rng.gauss(0, 3_000)
            n += "rising demand" in p.decide(signals(10 * i, prefill=13, tokens_per_s=60_000 + x)).reason
        return n

    independent, corrected = rising_ticks(), rising_ticks(trend_autocorrelation=True)
    assert independent > 30 and corrected < independent / 2
    # a steady ramp (+100 tokens/s each 10 s window, small independent noise) still reads as a rise
    rng, p = random.Random(3), planner(target_utilisation=0.5, lookahead_s=120, trend_window_s=300,
                                       trend_autocorrelation=True)
    reasons = [p.decide(signals(10 * i, prefill=13, tokens_per_s=40_000 + 100 * i + rng.gauss(0, 300))).reason
               for i in range(100)]
    assert sum("rising demand" in r for r in reasons[40:]) > 30


def test_down_hold_recent_keeps_workers_a_burst_needs():
    # prefill's windows swing 12-28k tokens/s (4 workers at 10k each at target 0.5, by the trimmed mean) on 6
    # running; then two windows of 30k: within the swings' three standard deviations, so not a step, and the
    # trimmed mean hardly moves. Plain, the hysteresis scales down inside them; with down_hold_recent the
    # last two windows' 6 workers hold
    def prefill_at(t_end, **config):
        p = planner(target_utilisation=0.5, trend_window_s=300, down_after_s=50, **config)
        d = None
        for i in range(30):
            d = p.decide(signals(10 * i, prefill=6, tokens_per_s=20_000 + (8_000 if i % 2 else -8_000), kv=100))
        for t in range(300, t_end + 1, 10):
            d = p.decide(signals(t, prefill=6, tokens_per_s=30_000, kv=100))
        return d.prefill

    assert prefill_at(310) == 5
    assert prefill_at(310, down_hold_recent=True) == 6
    # without the burst's windows it scales down as before
    assert prefill_at(290) == prefill_at(290, down_hold_recent=True) == 5


def test_held_level_recent_follows_held_kv_at_once():
    # decode's KV swings 2,400-3,600 blocks for a trend window (5 workers at 700 blocks each at target), then
    # stands at 4,500 for two windows: a rise within the swings' three standard deviations, so not a step, and
    # the trend window's trimmed mean hardly moves. With held_level_recent the blocks held now set the count
    def decode_after(**config):
        p = planner(kv_target=0.7, trend_window_s=300, **config)
        for i in range(30):
            p.decide(signals(10 * i, decode=5, tokens_per_s=1000, kv=3000 + (600 if i % 2 else -600), running=10))
        return [p.decide(signals(300 + 10 * i, decode=5, tokens_per_s=1000, kv=4500, running=10)).decode
                for i in range(2)][-1]

    assert decode_after() == 5
    assert decode_after(held_level_recent=True) == 7  # 4,500 / 700 -> 6.4
    # the prompt tokens' rate keeps the trimmed mean: one clump of prompts finishing is not a level
    p = planner(target_utilisation=0.5, trend_window_s=300, held_level_recent=True)
    for i in range(30):
        p.decide(signals(10 * i, prefill=6, tokens_per_s=25_000 + (5_000 if i % 2 else -5_000), kv=100))
    assert [p.decide(signals(300 + 10 * i, prefill=6, tokens_per_s=40_000, kv=100)).prefill for i in range(2)][-1] == 6
