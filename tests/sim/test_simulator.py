"""The cluster simulator: deterministic, driven by the real router code, its worker model sane."""

import copy
import gc
import json

import pytest

from services.router import policy as router_policy
from services.sim.autoscale import SimAutoscaler
from services.sim.admission import SimAdmission
from services.sim.cluster import ClusterConfig, ClusterSim
from services.sim.metrics import SLO, summarize
from services.sim.profiles import load_profile
from services.sim.workloads import (
    ArrivalShape,
    SimRequest,
    WorkloadGenerator,
    routing_bench_workload,
)

SLO_ = SLO(2.0, 0.05)


def small_run(seed=1, policy="kv-aware", workers=(2, 4), rate=2.0, duration=60.0, **config):
    profile = load_profile("h100")
    reqs = WorkloadGenerator(seed, profile.block_size).sessions(ArrivalShape(rate=rate, duration_s=duration))
    sim = ClusterSim(ClusterConfig(profile, workers[0], workers[1], policy=policy, **config), reqs).run()
    return sim


def fingerprint(sim):
    return [(j.req.id, j.prefill_worker, j.decode_worker, round(j.first_token_at, 9), round(j.finished_at, 9),
             j.cached_tokens) for j in sim.jobs]


def test_a_seed_gives_the_same_run_and_another_seed_another():
    a, b = small_run(seed=7), small_run(seed=7)
    assert fingerprint(a) == fingerprint(b)
    assert json.dumps(summarize(a, SLO_)) == json.dumps(summarize(b, SLO_))
    assert fingerprint(small_run(seed=8)) != fingerprint(a)


def test_every_request_finishes_and_every_block_comes_back():
    sim = small_run()
    assert sim.jobs and all(j.finished_at >= j.first_token_at > j.req.arrival for j in sim.jobs)
    assert sim.inflight == 0 and not len(sim.admission)
    for w in sim.workers.values():
        assert w.idle()
    assert all(load == 0 for load in (sim.pool.load(w).inflight_requests for w in sim.workers))


def test_a_run_leaves_nothing_for_the_paused_collector():
    # a run keeps the cyclic garbage collector off (events.collector_paused): a reference cycle made per event
    # would stay in memory until the run ends, and a day is millions of events. The planner, the stepped prefill
    # workers (a measured profile) and the kv-aware router all run here
    profile = load_profile("h100-measured")
    reqs = WorkloadGenerator(3, profile.block_size).sessions(ArrivalShape(rate=4.0, duration_s=120.0))
    sim = ClusterSim(ClusterConfig(profile, 1, 1), reqs)
    SimAutoscaler("planner", profile, SLO_).attach(sim)
    found = []
    sim.loop.at(899.0, lambda: found.append((gc.isenabled(), gc.collect())))  # from inside the run, paused
    gc.collect()
    sim.run(until=900.0)
    assert len(sim.jobs) == len(reqs) and all(j.finished_at > 0 for j in sim.jobs)
    assert found == [(False, 0)]  # every object the run dropped was freed by its reference count
    assert gc.isenabled()  # back as it was


def test_the_routing_policy_decides():
    kv = summarize(small_run(policy="kv-aware"), SLO_)
    rr = summarize(small_run(policy="round-robin"), SLO_)
    assert kv["hit_rate"] > rr["hit_rate"]


def test_a_burst_between_two_heartbeats_spreads_over_the_decode_workers():
    # the router's view of the decode workers changes only by its own in-flight counts until the next
    # heartbeat (1 s): before a disaggregated request counted on its decode worker, all went to one
    sim = small_run(workers=(1, 4), rate=100.0, duration=0.3)
    burst = [j for j in sim.jobs if j.dispatched_at < 1.0 and j.decode_worker]
    per_worker = {}
    for j in burst:
        per_worker[j.decode_worker] = per_worker.get(j.decode_worker, 0) + 1
    assert len(burst) >= 20 and len(per_worker) == 4
    assert max(per_worker.values()) - min(per_worker.values()) <= 1


def test_it_is_the_router_code_that_runs(monkeypatch):
    """Patch the production policy class: the simulator's choices follow the patch."""
    before = small_run()
    assert len({j.prefill_worker for j in before.jobs}) == 2

    def always_last(self, candidates, *args):
        return router_policy.Decision(candidates[-1], "load")

    monkeypatch.setattr(router_policy.KVAwarePolicy, "_pick_prefill", always_last)
    after = small_run()
    assert {j.prefill_worker for j in after.jobs} == {"prefill-0002"}


def test_one_request_costs_what_the_profile_says():
    profile = load_profile("h100")
    req = SimRequest(0, 1.0, "standard", list(range(100, 132)), 32 * 64, 101)
    sim = ClusterSim(ClusterConfig(profile, 1, 1, disaggregation="always"), [req]).run()
    job = sim.jobs[0]
    prefill = profile.prefill_s(req.num_tokens, req.num_tokens)
    assert job.first_token_at - req.arrival == pytest.approx(prefill + profile.transfer_s(req.num_tokens))
    # 100 more tokens, one per decode step of a batch of one whose context grows from 2,049 to 2,148
    steps = [profile.decode_step_s(1, req.num_tokens + 1 + k) for k in range(100)]
    assert job.finished_at - job.first_token_at == pytest.approx(sum(steps), rel=1e-3)


def test_a_full_decode_worker_makes_requests_wait_not_fail():
    profile = load_profile("h100").with_kv_blocks(40)
    reqs = [SimRequest(i, 0.0, "standard", [10_000 * i + k for k in range(16)], 16 * 64, 200) for i in range(4)]
    sim = ClusterSim(ClusterConfig(profile, 1, 1, disaggregation="always"), reqs).run()
    # 16 + 4 blocks each: two fit at a time, so the last two start only when the first two end
    first = sorted(j.first_token_at for j in sim.jobs)
    finished = sorted(j.finished_at for j in sim.jobs)
    assert all(j.finished_at > 0 for j in sim.jobs)
    assert first[2] > finished[0]


def test_admission_runs_the_production_dequeue_script():
    queue = SimAdmission()
    for i in range(24):
        queue.add(("i", i), "interactive")
    for i in range(12):
        queue.add(("s", i), "standard")
        queue.add(("b", i), "batch")
    order = "".join(queue.next()[0] for _ in range(24))
    assert (order.count("i"), order.count("s"), order.count("b")) == (16, 6, 2)  # weights 8 / 3 / 1
    assert order[:12] == "isiibisiiisi"
    with pytest.raises(ValueError):
        queue.add("x", "nope")


def test_validation_workload_matches_bench_routing():
    reqs = routing_bench_workload(0, 16)
    assert len(reqs) == 200 and all(1024 + 16 <= r.num_tokens <= 1024 + 32 for r in reqs)
    assert len({tuple(r.hashes[:64]) for r in reqs}) == 8  # eight shared 64-block system prompts


def test_workload_mix_follows_its_parameters():
    reqs = WorkloadGenerator(3, 16).sessions(ArrivalShape(rate=20, duration_s=300))
    kinds = {r.kind for r in reqs}
    assert kinds == {"chat", "system-prompt", "rag", "agent"}
    rag = sorted(r.num_tokens for r in reqs if r.kind == "rag")
    assert 5000 < sum(rag) / len(rag) < 10_000  # Mooncake's average input is 7,590 tokens
    assert copy.deepcopy(reqs[0]).hashes == reqs[0].hashes


def test_bad_configuration_is_a_clear_error():
    profile = load_profile("h100")
    with pytest.raises(ValueError, match="disaggregation"):
        ClusterConfig(profile, 1, 1, disaggregation="sometimes")
    with pytest.raises(ValueError, match="unknown worker profile"):
        load_profile("tpu")
    with pytest.raises(ValueError):
        ArrivalShape(rate=0, duration_s=10)


def test_bench_sim_command_prints_the_headline_and_writes_plots_and_results(tmp_path):
    """``pdserve bench sim --json`` end to end at a small size: the acceptance keys, PNGs, the result file."""
    import json
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "bench", "sim", "--workers", "8", "--requests", "300",
         "--parts", "policies,validation,autoscale", "--period-s", "300", "--autoscale-rate", "0.2",
         "--planner-targets", "0.6", "--headline-target", "0.6", "--threshold-targets", "0.7",
         "--check-trace", "conversation:1", "--json",
         "--plots", str(tmp_path / "plots"), "--save", str(tmp_path / "results")],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    for key in ("workers", "requests", "wall_s", "hit_rate_ratio_kv_vs_rr", "goodput_ratio_kv_vs_rr",
                "autoscale_slo_attainment", "autoscale_worker_hours_vs_static", "validation"):
        assert key in out, key
    assert (out["workers"], out["requests"]) == (8, 300)
    assert set(out["policies"]) == {"round-robin", "least-load", "kv-aware", "kv-aware-lb"}
    assert set(out["validation"]["real"]) == set(out["validation"]["sim"])
    # static peak searched to the smallest meeting 99% over the day and in each of its bursts (the default
    # --static-goal); the check trace run and reported
    peak = out["autoscale"]["static_peak"]
    assert peak["slo_attainment"] >= 0.99 and peak["workers"] == peak["prefill"] + peak["decode"]
    assert out["autoscale_static_goal"] == "bursts" and len(peak["windows"]) == 2
    assert all(w["slo_attainment"] >= 0.99 for w in peak["windows"])
    assert out["autoscale_ideal_worker_hours_vs_static"] == out["autoscale"]["ideal_worker_hours_vs_static"]
    assert 0 < out["autoscale_ideal_worker_hours_vs_diurnal_peak"] <= 1
    # the planner's bursts judged as static's are: each run's windows, the least of the headline's as a key
    headline = out["autoscale"]["headline_run"]
    assert [(w["start_s"], w["end_s"]) for w in headline["windows"]] == \
        [(w["start_s"], w["end_s"]) for w in peak["windows"]]
    assert out["autoscale_burst_slo_attainment"] == min(w["slo_attainment"] for w in headline["windows"])
    assert all(len(r["windows"]) == 2 for r in out["autoscale"]["threshold"])
    assert out["autoscale_check"]["trace_shape"] == "conversation" and out["autoscale_check"]["seed"] == 1
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs and all((tmp_path / "plots" / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)
    saved = list((tmp_path / "results").glob("sim-*.json"))
    assert len(saved) == 1


def test_bench_sim_rejects_an_unknown_part_or_policy_set():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "services.cli", "bench", "sim", "--parts", "policies,nope"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "unknown parts ['nope']" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "services.cli", "bench", "sim", "--policies", "kv-aware"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--policies must include kv-aware and round-robin" in proc.stderr


@pytest.mark.parametrize("peer_fetch", [False, True])
def test_a_peer_fetch_the_router_plans_copies_the_prefix_instead_of_computing_it(peer_fetch):
    profile = load_profile("h100")
    shared = list(range(100, 132))  # 32 blocks
    reqs = [SimRequest(0, 0.0, "standard", shared, 32 * 64, 2),
            # keeps the holder busy: 200 blocks to compute, 0.25 x 12,800 > the 2,048 tokens the next prompt saves
            SimRequest(1, 1.0, "standard", shared + list(range(5000, 5200)), 232 * 64, 2),
            SimRequest(2, 1.001, "standard", shared + [999], 33 * 64, 2)]
    options = {"peer_fetch": peer_fetch, "peer_fetch_bandwidth_gbps": 40,
               "peer_fetch_prefill_tokens_per_s": 1 / profile.prefill_per_token_s}
    sim = ClusterSim(ClusterConfig(profile, 2, 1, disaggregation="always", policy_options=options), reqs).run()
    first, busy, moved = sim.jobs
    assert first.prefill_worker == busy.prefill_worker == "prefill-0001"
    assert moved.prefill_worker == "prefill-0002"  # the holder's queue outweighs the prefix
    prefill_s = moved.extra["prefilled_at"] - moved.dispatched_at
    if not peer_fetch:
        assert moved.cached_tokens == 0 and "fetched_blocks" not in moved.extra
        assert prefill_s == pytest.approx(profile.prefill_s(33 * 64, 33 * 64) + profile.prefill_request_s)
        return
    # 32 blocks of 8 MiB at 40 GB/s, the fetch's round trips, the holder's prefill chunk under way, then one block
    assert moved.extra["fetched_blocks"] == 32 and moved.cached_tokens == 32 * 64
    fetch_s = 32 * 64 * profile.kv_bytes_per_token / 40e9 + 0.005 + 512 * profile.prefill_per_token_s
    assert prefill_s == pytest.approx(fetch_s + profile.prefill_s(64, 33 * 64) + profile.prefill_request_s)
    assert sim.workers["prefill-0002"].cache.keys() >= set(shared)  # cached there now, and the index knows it
    assert sim.index.overlaps(shared)["prefill-0002"] == 32


@pytest.mark.parametrize("spill_blocks", [0, 100])
def test_a_prefill_workers_spill_tier_keeps_evicted_blocks_and_copies_them_back(spill_blocks):
    profile = load_profile("h100").with_kv_blocks(40)
    a, b = list(range(100, 132)), list(range(500, 532))  # 32 blocks each: b pushes 24 of a's out of the pool
    reqs = [SimRequest(0, 0.0, "standard", a, 32 * 64, 2), SimRequest(1, 1.0, "standard", b, 32 * 64, 2),
            SimRequest(2, 2.0, "standard", a + [999], 33 * 64, 2)]
    sim = ClusterSim(ClusterConfig(profile, 1, 1, disaggregation="always", prefill_spill_blocks=spill_blocks),
                     reqs).run()
    again = sim.jobs[2]
    prefill_s = again.extra["prefilled_at"] - again.dispatched_at
    if not spill_blocks:
        # the pool kept b and a's first 8 blocks (a prompt's tail is evicted first): the other 25 are computed
        assert again.cached_tokens == 8 * 64
        assert prefill_s == pytest.approx(profile.prefill_s(25 * 64, 33 * 64) + profile.prefill_request_s)
        return
    # all 32 blocks of a hit, 24 of them copied back from the spill tier at 25 GB/s; one block computed
    assert again.cached_tokens == 32 * 64 and again.extra["restored_blocks"] == 24
    restore_s = 24 * 64 * profile.kv_bytes_per_token / 25e9
    assert prefill_s == pytest.approx(restore_s + profile.prefill_s(64, 33 * 64) + profile.prefill_request_s)
    # the index heard of the spill (a hit there is priced as a restore), and of the copy back into the pool
    worker = sim.workers["prefill-0001"]
    assert len(worker.cache) == 40 and set(a) <= set(worker.cache) and sim.index.spilled_run(worker.worker_id, b, 32) > 0
    assert sim.index.spilled_run(worker.worker_id, a, 32) == 0
    with pytest.raises(ValueError, match="spill tier"):
        ClusterConfig(load_profile("cpu"), 1, 1, prefill_spill_blocks=10)
