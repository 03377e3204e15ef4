"""The planner driving the simulated cluster on small crafted traces: what a person watching it would see.

Each trace is a few hundred hand-made requests (2,048-token prompts, no shared prefix, 32 output
tokens) on the h100 profile (cold start 120 s, warm start 2 s), 10 s planner ticks.
"""

from services.planner.policy import PlannerConfig
from services.sim import experiments
from services.sim.autoscale import SimAutoscaler
from services.sim.cluster import ClusterConfig, ClusterSim
from services.sim.day_scale import DayScale
from services.sim.metrics import SLO, ttft
from services.sim.profiles import load_profile
from services.sim.workloads import SimRequest

PROFILE = load_profile("h100")
SLO_ = SLO(2.0, 0.05)
PROMPT, OUT = 2048, 32


def trace(*phases):
    """``phases``: (start s, end s, requests per second), evenly spaced; every prompt its own blocks."""
    reqs, block = [], 0
    blocks = PROMPT // PROFILE.block_size
    for start, end, rate in phases:
        n = round((end - start) * rate)
        for i in range(n):
            reqs.append(SimRequest(len(reqs), start + i / rate, "standard", list(range(block, block + blocks)),
                                   PROMPT, OUT))
            block += blocks
    return reqs


def run(reqs, **config):
    sim = ClusterSim(ClusterConfig(PROFILE, 1, 1), reqs)
    scaler = SimAutoscaler("planner", PROFILE, SLO_, planner_config=PlannerConfig(**config))
    scaler.attach(sim)
    sim.run(until=3600)  # bounded: a planner that never wakes would otherwise retry forever
    return sim, scaler


def active(d):
    return d["prefill"] + d["decode"]


def test_a_burst_scales_up_on_demand_before_the_slo_breaks():
    # 2 req/s for 5 minutes (the cluster settles), then 12 req/s
    sim, scaler = run(trace((0, 300, 2), (300, 420, 12)), warm_min=4)
    before = max(active(d) for d in scaler.decisions if 250 <= d["t"] < 300)
    up = next(d for d in scaler.decisions if d["t"] >= 300 and active(d) > before)
    assert up["t"] <= 320  # within two ticks of the burst
    assert "attainment" not in up["reason"]  # from the demand and queue signals, not from missed SLOs
    # the warm standbys carried it: the burst's requests kept their SLO
    burst = [j for j in sim.jobs if j.req.arrival >= 300]
    assert sum(SLO_.met(j) for j in burst) / len(burst) >= 0.99


def test_a_fall_in_demand_is_held_for_the_hysteresis_window_then_stepped_down():
    sim, scaler = run(trace((0, 400, 12), (400, 1000, 1)), down_after_s=200, down_step=0.25)
    at_fall = next(d for d in scaler.decisions if d["t"] >= 400)
    held = [d for d in scaler.decisions if at_fall["t"] <= d["t"] < 400 + 190]
    assert held and all(active(d) >= active(at_fall) for d in held)  # nothing released inside the window
    later = [d for d in scaler.decisions if d["t"] >= 400 + 230]
    assert later and active(later[-1]) < active(at_fall)
    steps = [active(a) - active(b) for a, b in zip(later, later[1:])]
    assert all(s <= max(1, active(at_fall) // 4) for s in steps)  # a quarter at most per tick


def test_a_warm_standby_is_promoted_in_seconds_and_the_pool_refills():
    # the pool (2 standbys) fills during the first 2 minutes of quiet, then a burst needs more workers
    sim, scaler = run(trace((0, 200, 1), (200, 320, 40)), warm_min=2, warm_fraction=0.0)
    assert next(d for d in scaler.decisions if d["t"] >= 190)["warm"] == 2
    workers = list(sim.workers.values()) + sim.retired
    added = [w for w in workers if 200 <= w.started_at < 215]
    start_s = sorted(round(w.ready_at - w.started_at, 3) for w in added)
    assert start_s[:2] == [PROFILE.warm_start_s] * 2  # the two standbys, registered in seconds
    assert all(s == PROFILE.cold_start_s for s in start_s[2:])  # the rest start cold
    after = next(d for d in scaler.decisions if d["t"] >= 215)
    assert after["warm"] + after["warming"] == 2  # cold starts refill the pool
    # the run's pool events say the same: the burst's first two from the pool, the rest cold, the pool
    # loaded cold twice at the start and once for each standby the burst took
    cold = [w for w in workers if round(w.ready_at - w.started_at, 3) == PROFILE.cold_start_s]
    assert scaler.pool_events["warm"] >= 2 and scaler.pool_events["cold"] == len(cold) >= len(start_s) - 2
    assert scaler.pool_events["standby"] >= 4


def test_an_idle_model_scales_to_zero_keeps_its_standby_and_serves_the_next_request():
    reqs = trace((0, 60, 2))
    late = SimRequest(len(reqs), 60 + 600 + 300, "standard", [10**9], 16, OUT)
    sim, scaler = run(reqs + [late], idle_to_zero_s=600, warm_min=1, warm_fraction=0.0)
    idle = [d for d in scaler.decisions if 60 + 600 + 20 <= d["t"] < late.arrival]
    assert idle and all(active(d) == 0 and d["reason"] == "idle: scaled to zero" for d in idle)
    assert all(d["warm"] + d["warming"] == 1 for d in idle)  # one standby kept, model loaded
    job = next(j for j in sim.jobs if j.req is late)
    assert job.finished_at > 0 and ttft(job) < PROFILE.cold_start_s + 30  # woken, not lost
    # while idle only the standby is charged: a worker-second a second
    assert not any(w.ready_at <= 700 < getattr(w, "retired_at", 1e9) for w in sim.retired + list(sim.workers.values()))


def test_with_a_standby_hold_the_worker_a_dip_released_serves_its_recovery_without_a_cold_load():
    # 12 req/s, a 4-minute dip to 1 req/s (the planner drains workers after its 60 s hold), then 12 req/s again
    reqs = trace((0, 300, 12), (300, 540, 1), (540, 840, 12))
    _, plain = run(reqs, down_after_s=60, warm_min=1)
    sim, held = run(reqs, down_after_s=60, warm_min=1, standby_hold_s=600)
    assert "parked" not in plain.pool_events  # without a hold the drained worker left (the pool was full)...
    assert held.pool_events["parked"] >= 1  # ...with one it waited in the pool...
    assert "standby released" not in held.pool_events  # ...none was let go within the hold...
    # ...and the recovery took it: one cold load fewer (the pool is refilled by the load the hold saved)
    assert held.pool_events["standby"] < plain.pool_events["standby"]
    recovery = [j for j in sim.jobs if j.req.arrival >= 540]
    assert sum(SLO_.met(j) for j in recovery) / len(recovery) >= 0.99


def test_the_routers_options_reach_an_autoscaled_day_and_a_saturated_prefill_tier_spills_to_decode():
    # 2 req/s, then a burst of 20 req/s that one prefill worker cannot keep up with, no standby: the planner's
    # next prefill worker is a cold start (120 s) away. With the router's prefill_queue_limit_tokens the decode
    # workers prefill what would wait past that queue, and the burst's first tokens come sooner
    reqs = trace((0, 300, 2), (300, 420, 20))
    day = DayScale(86_400)

    def autoscaled(options):
        return experiments._autoscaled(PROFILE, reqs, SLO_, day, "planner", PlannerConfig(warm_min=0),
                                       windows=[(300, 420)], policy_options=options)

    plain, spilled = autoscaled({}), autoscaled({"prefill_queue_limit_tokens": 8192})
    assert plain["local_prefill_share"] == 0
    assert spilled["local_prefill_share"] > 0
    # the burst lost almost every request waiting for the one prefill worker; the decode worker's help met it
    assert plain["windows"][0]["slo_attainment"] < 0.5
    assert spilled["windows"][0]["slo_attainment"] >= 0.99
