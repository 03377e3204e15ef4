"""The CPU validation's worker model: shared cores and the engine's prefill steps, against the arithmetic."""

import dataclasses

import pytest

from services.sim.cluster import ClusterConfig, ClusterSim
from services.sim.profiles import load_profile
from services.sim.workloads import SimRequest, routing_bench_workload

BS = 16


def cpu(steps: int = 0, chunk: int = 0):
    # without the front door's measured load, which the tests that want it set themselves
    return dataclasses.replace(load_profile("cpu"), prefill_step_tokens=steps, prefill_chunk_tokens=chunk,
                               frontdoor_cpu_s=0.0, frontdoor_busy_cores=0.0)


def request(i: int, tokens: int, first_hash: int) -> SimRequest:
    return SimRequest(i, 0.0, "standard", list(range(first_hash, first_hash + tokens // BS)), tokens, 2)


def run(profile, requests, prefill=1, host_cores=0):
    sim = ClusterSim(ClusterConfig(profile, prefill, 1, policy="round-robin", disaggregation="always",
                                   closed_loop=len(requests), host_cores=host_cores), requests)
    return {j.req.id: j for j in sim.run().jobs}


def test_two_prefills_on_one_core_take_twice_as_long_as_on_two():
    profile = cpu()
    reqs = [request(0, 512, 0), request(1, 512, 1000)]
    alone = profile.prefill_s(512, 512) + profile.transfer_s(512)
    own = run(profile, [dataclasses.replace(r) for r in reqs], prefill=2)
    assert [own[i].first_token_at for i in (0, 1)] == pytest.approx([alone, alone])
    shared = run(profile, [dataclasses.replace(r) for r in reqs], prefill=2, host_cores=1)
    both = 2 * profile.prefill_s(512, 512) + profile.transfer_s(512)  # two computing on one core: half speed
    assert [shared[i].first_token_at for i in (0, 1)] == pytest.approx([both, both])


def test_a_short_prompt_shares_the_long_ones_first_step_instead_of_waiting_for_all_of_it():
    long, short = request(0, 2048, 0), request(1, 32, 5000)
    fifo = run(cpu(), [dataclasses.replace(long), dataclasses.replace(short)])
    assert fifo[1].first_token_at > fifo[0].first_token_at  # one prompt at a time: behind the whole long one
    p = cpu(1024, 512)
    stepped = run(p, [dataclasses.replace(long), dataclasses.replace(short)])
    # the long prompt's first chunk is under way when the short one arrives: it joins the next step
    step1 = p.prefill_base_s + p.prefill_per_token_s * 512 + p.prefill_per_token_context_s * 512 * 512
    step2 = p.prefill_base_s + p.prefill_per_token_s * (512 + 32) \
        + p.prefill_per_token_context_s * (512 * 1024 + 32 * 32)
    assert stepped[1].first_token_at == pytest.approx(step1 + step2 + p.transfer_s(32))
    assert stepped[0].first_token_at > step1 + step2 + 2 * p.prefill_base_s  # four 512-token chunks


def test_a_prompt_whose_prefix_another_is_computing_waits_for_it_and_hits():
    p = cpu(1024, 512)
    first, second = request(0, 1024, 0), request(1, 1024, 0)  # the same blocks
    jobs = run(p, [first, second])
    assert jobs[0].cached_tokens == 0 and jobs[1].cached_tokens == 1024
    assert jobs[1].first_token_at > jobs[0].first_token_at


def test_the_synthetic_routing_workload_uses_every_prompt_equally_often_as_the_bench():
    reqs = routing_bench_workload(3, BS)
    counts = {}
    for r in reqs:
        counts[r.hashes[0]] = counts.get(r.hashes[0], 0) + 1
    assert sorted(counts.values()) == [25] * 8


def test_the_front_door_takes_its_share_of_a_shared_core():
    reqs = [request(0, 512, 0)]
    prefill = cpu().prefill_s(512, 512)
    alone = run(cpu(), [dataclasses.replace(reqs[0])], host_cores=1)[0].first_token_at
    assert alone == pytest.approx(prefill + cpu().transfer_s(512))
    front = prefill / 4  # CPU seconds the router, Redis and the client spend on the request
    profile = dataclasses.replace(cpu(), frontdoor_cpu_s=front)
    shared = run(profile, [dataclasses.replace(reqs[0])], host_cores=1)[0].first_token_at
    # both at half speed until the front door's work is done (2 x front), then the prefill alone
    assert shared == pytest.approx(prefill + front + cpu().transfer_s(512))
    # with a core each, the front door slows nobody
    assert run(profile, [dataclasses.replace(reqs[0])], host_cores=2)[0].first_token_at == pytest.approx(alone)


def test_the_front_doors_steady_load_takes_cores_from_the_workers():
    reqs = [request(0, 512, 0), request(1, 512, 1000)]
    profile = dataclasses.replace(cpu(), frontdoor_busy_cores=1.0)
    both = run(profile, [dataclasses.replace(r) for r in reqs], prefill=2, host_cores=2)
    # two prefills on the one core left: half speed each
    expected = 2 * cpu().prefill_s(512, 512) + cpu().transfer_s(512)
    assert [both[i].first_token_at for i in (0, 1)] == pytest.approx([expected, expected])


def test_a_run_whose_machine_was_busy_is_simulated_on_the_cores_left():
    from services.sim.validation import simulate_bench

    reqs = routing_bench_workload(0, BS)
    quiet = simulate_bench(load_profile("cpu"), reqs, ["round-robin"])["round-robin"]
    busy = simulate_bench(load_profile("cpu"), reqs, ["round-robin"], {"round-robin": 1.0})["round-robin"]
    # round-robin's prefill workers are always computing: on half the cores, about half the throughput
    assert busy["requests_per_s"] < 0.7 * quiet["requests_per_s"]
    assert busy["ttft_s"]["mean"] > 1.4 * quiet["ttft_s"]["mean"]


def test_a_queued_prefix_hit_loads_its_worker_by_its_uncached_tokens_only():
    from services.sim.workers import Job

    p = cpu(1024, 512)
    sim = ClusterSim(ClusterConfig(p, 1, 1, policy="round-robin", disaggregation="always", closed_loop=1),
                     [request(0, 1024, 0)])
    sim.run()  # the 1,024-token prefix is cached on the prefill worker
    worker = next(w for w in sim.workers.values() if w.role == "prefill")
    worker._step_work = [("busy", 1)]  # mid-step: new requests wait in the queue
    hit, miss = Job(request(1, 1024 + 32, 0)), Job(request(2, 256, 9000))
    worker.submit(hit)
    worker.submit(miss)
    # as the engine's Scheduler.queued_prefill_tokens: the hit's 32 tokens past the prefix, the miss's 256
    assert worker.heartbeat(sim.loop.now).queued_prefill_tokens == 32 + 256


def test_a_first_token_leaves_the_decode_worker_when_its_step_under_way_ends():
    from services.sim.workers import Job

    p = dataclasses.replace(cpu(), first_token_at_step=True)
    sim = ClusterSim(ClusterConfig(p, 1, 1, policy="round-robin", disaggregation="always"), [])
    decode = next(w for w in sim.workers.values() if w.role == "decode")
    running = Job(request(0, 64, 0))
    running.req.out_tokens = 1000
    running.blocks = 8
    decode.reserve(running)
    decode.join(running)
    step = decode.step_s()
    sim.loop.at(2.25 * step, lambda: None)
    sim.loop.run(2.25 * step)  # a quarter into the third step
    # (a step grows a little with the context: within 0.1%)
    assert decode.to_step_boundary(sim.loop.now) == pytest.approx(0.75 * step, rel=1e-3)
    newcomer = Job(request(1, 64, 500))
    newcomer.blocks, newcomer.decode_worker = 8, decode.worker_id
    decode.reserve(newcomer)
    sim._kv_arrived(newcomer)
    sim.loop.run(2.9 * step)
    assert newcomer.first_token_at == -1.0  # still waiting for the step to end
    sim.loop.run(3.1 * step)
    assert newcomer.first_token_at == pytest.approx(3 * step, rel=1e-3)


def _decode_phase(profile, host_cores):
    req = SimRequest(0, 0.0, "standard", list(range(4)), 64, 33)  # 32 decode steps after the first token
    sim = ClusterSim(ClusterConfig(profile, 1, 1, policy="round-robin", disaggregation="always", closed_loop=1,
                                   host_cores=host_cores), [req]).run()
    job = sim.jobs[0]
    decode = next(w for w in sim.workers.values() if w.role == "decode")
    return job.finished_at - job.first_token_at, decode


def test_a_decode_workers_event_loop_runs_beside_its_steps_and_takes_a_shared_hosts_cores():
    plain = cpu()
    served = dataclasses.replace(plain, decode_loop_cpu_share=0.5)
    step = plain.decode_step_s(1, 64 + 1)  # ~the batch of one's step (its context grows a little)
    # cores enough for every thread: the loop's work does not lengthen the steps
    alone, _ = _decode_phase(plain, 8)
    beside, decode = _decode_phase(served, 8)
    assert alone == pytest.approx(32 * step, rel=0.02)
    assert beside == pytest.approx(alone)
    assert decode.loop_busy_s == pytest.approx(0.5 * decode.busy_s)  # the loop did its share of work
    # one core: the loop's thread and the engine's share it, 1.5 threads on 1 core
    one_core, _ = _decode_phase(served, 1)
    assert one_core == pytest.approx(1.5 * alone)



def test_a_prefill_workers_cost_per_request_is_paid_in_the_step_that_finishes_each_prompt():
    # (first tokens leave on arrival: the decode worker's step under way is another test's subject)
    p = dataclasses.replace(cpu(1024, 512), prefill_request_s=0.05, first_token_at_step=False)
    long, short = request(0, 1024, 0), request(1, 32, 5000)
    jobs = run(p, [long, short])

    def step(chunks):
        return (p.prefill_base_s + p.prefill_per_token_s * sum(n for n, _ in chunks)
                + p.prefill_per_token_context_s * sum(n * c for n, c in chunks))

    # step 1: the long prompt's first 512 alone (the short one arrives while it runs); step 2: the long one's
    # last 512 and the short one whole: both finish, so it pays the per-request cost twice
    both = step([(512, 512)]) + step([(512, 1024), (32, 32)]) + 2 * 0.05
    assert jobs[1].first_token_at == pytest.approx(both + p.transfer_s(32))
    assert jobs[0].first_token_at == pytest.approx(both + p.transfer_s(1024))
