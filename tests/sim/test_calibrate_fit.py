"""The cpu profile's cost fits (services/sim/calibrate.py): exact on exact points, and a small batch's step
fitted as closely as a large one's."""

import pytest

from services.sim.calibrate import fit


def test_exact_points_give_back_their_coefficients():
    prefill = [(n, ctx, 0.04 + 0.002 * n + 3e-7 * n * ctx) for n, ctx in ((16, 16), (256, 256), (1024, 1024),
                                                                        (16, 1040), (256, 1280))]
    decode = [(b, ctx, 0.04 + 0.0025 * b + 2e-6 * b * ctx) for b in (1, 4, 16, 64) for ctx in (128, 1024)]
    f = fit({"prefill_points": prefill, "decode_points": decode})
    assert f["prefill_s"] == pytest.approx({"base": 0.04, "per_token": 0.002, "per_token_context": 3e-7})
    assert f["decode_step_s"] == pytest.approx({"base": 0.04, "per_seq": 0.0025, "per_seq_context": 2e-6})


def test_a_small_batchs_step_is_not_sacrificed_to_the_large_ones():
    # batch 1 steps of ~40 ms beside batch-64 steps of ~0.3 s that do not lie on the same plane
    decode = [(1, 128, 0.039), (4, 128, 0.050), (16, 128, 0.071), (64, 128, 0.225), (1, 1024, 0.049),
              (4, 1024, 0.062), (16, 1024, 0.131), (64, 1024, 0.318), (64, 512, 0.321), (16, 512, 0.306)]
    prefill = [(16, 16, 0.065), (1024, 1024, 2.4), (16, 1040, 0.076)]
    d = fit({"prefill_points": prefill, "decode_points": decode})["decode_step_s"]
    step = d["base"] + d["per_seq"] + d["per_seq_context"] * 128
    assert step == pytest.approx(0.039, rel=0.25)  # a plain least-squares fit gives 68 ms here


def test_a_served_worker_costs_the_engines_compute_times_its_measured_factor():
    import dataclasses

    from services.sim.profiles import load_profile

    p = dataclasses.replace(load_profile("cpu"), worker_cpu_factor={"prefill": 1.25, "decode": 1.5})
    served = p.served()
    assert served.prefill_s(512, 1024) == pytest.approx(1.25 * p.prefill_s(512, 1024))
    # the decode worker's steps are the engine's; the rest of its CPU is its event loop's, beside them
    assert served.decode_step_s(8, 8000) == pytest.approx(p.decode_step_s(8, 8000))
    assert served.decode_loop_cpu_share == pytest.approx(0.5)
    plain = dataclasses.replace(p, worker_cpu_factor={}).served()
    assert plain.prefill_s(64, 64) == p.prefill_s(64, 64) and plain.decode_loop_cpu_share == 0


def _points(**extra) -> dict:
    prefill = [(n, n, 0.01 + 1e-4 * n) for n in (16, 256, 1024)] + [(16, 1040, 0.012)]
    decode = [(b, ctx, 0.01 + 1e-4 * b + 1e-8 * b * ctx) for b in (1, 8) for ctx in (512, 2048)]
    pts = {"prefill_points": prefill, "decode_points": decode, "kv_blocks_default": 5000, "block_size": 16,
           "kv_bytes_per_block": 16 * 131072, **extra}
    pts["fit"] = fit(pts)
    return pts


def test_a_measured_gpu_profile_keeps_only_the_transfer_and_start_up_of_its_base(tmp_path):
    import json
    import shutil

    from services.sim.calibrate import into_profile
    from services.sim.profiles import CALIBRATION, load_profile

    cal = tmp_path / "calibration.json"
    shutil.copy(CALIBRATION, cal)
    pts = _points(model="dummy:llama-3.1-8b", dtype="bfloat16", device="NVIDIA H200", engine_start_s=12.0,
                  timed_by="wall clock")
    into_profile(pts, str(cal), "calibrate --device cuda", profile="new-gpu", base="h100")
    h200, h100 = load_profile("new-gpu", cal), load_profile("h100", cal)
    assert h200.decode_step_s(8, 8 * 2048) == pytest.approx(0.01 + 8e-4 + 8 * 2048e-8, rel=1e-6)
    assert (h200.kv_blocks, h200.block_size, h200.kv_bytes_per_token) == (5000, 16, 131072)  # the engine's
    assert (h200.transfer_bytes_per_s, h200.cold_start_s, h200.max_num_seqs) == \
        (h100.transfer_bytes_per_s, h100.cold_start_s, h100.max_num_seqs)
    source = json.loads(cal.read_text())["profiles"]["new-gpu"]["source"]
    assert "NVIDIA H200" in source["measured"] and "transfer" in source["kept from h100"]
    assert "decode [batch, context, s per step]" in source["points"]  # wall seconds, not CPU seconds
    assert load_profile("h100", cal).decode_base_s == load_profile("h100").decode_base_s  # the base is untouched


def test_a_new_profile_without_a_base_is_refused(tmp_path):
    import shutil

    from services.sim.calibrate import into_profile
    from services.sim.profiles import CALIBRATION

    cal = tmp_path / "calibration.json"
    shutil.copy(CALIBRATION, cal)
    with pytest.raises(ValueError, match="--base"):
        into_profile(_points(), str(cal), "note", profile="new-gpu", base=None)


def _measured_profiles() -> dict:
    """The shipped profiles whose source records the raw points they were fitted to (cpu, h200, h100-measured)."""
    import json

    from services.sim.profiles import CALIBRATION

    profiles = json.loads(CALIBRATION.read_text())["profiles"]
    return {name: entry for name, entry in profiles.items() if entry["source"].get("points")}


def test_the_measured_profiles_are_found():
    assert {"cpu", "h200", "h100-measured"} <= _measured_profiles().keys()


@pytest.mark.parametrize("name", sorted(_measured_profiles()))
def test_every_measured_profile_shipped_is_the_fit_of_its_own_recorded_points(name):
    # the profile `bench sim --profile NAME` simulates is what was measured: its coefficients are the fit of
    # the raw points its source records, and its decode steps stay within 15% of every point
    from services.sim.profiles import load_profile

    entry = _measured_profiles()[name]
    prefill, decode = entry["source"]["points"].values()
    refit = fit({"prefill_points": prefill, "decode_points": decode})
    assert entry["prefill_s"] == pytest.approx(refit["prefill_s"], rel=1e-9)
    assert entry["decode_step_s"] == pytest.approx(refit["decode_step_s"], rel=1e-9)
    profile = load_profile(name)
    for batch, ctx, seconds in decode:
        assert profile.decode_step_s(batch, batch * ctx) == pytest.approx(seconds, rel=0.15)


def test_a_gpu_calibration_runs_its_prefill_workers_in_the_engines_steps(tmp_path):
    # the engine was timed with 8,192 prompt tokens a step: the profile's prefill workers run such steps, so a
    # step's fixed cost (host-bound launches on a GPU) is paid once however many prompts it carries
    import shutil

    from services.sim.calibrate import into_profile
    from services.sim.profiles import CALIBRATION, load_profile

    cal = tmp_path / "calibration.json"
    shutil.copy(CALIBRATION, cal)
    gpu = _points(model="dummy:llama-3.1-8b", dtype="bfloat16", device="NVIDIA H100", engine_start_s=70.0,
                  timed_by="wall clock", prefill_step_tokens=8192)
    into_profile(gpu, str(cal), "calibrate --device cuda", profile="new-gpu", base="h100")
    assert (load_profile("new-gpu", cal).prefill_step_tokens, load_profile("new-gpu", cal).prefill_chunk_tokens) \
        == (8192, 8192)
    cpu_points = _points(timed_by="the thread's CPU time", prefill_step_tokens=2048)
    into_profile(cpu_points, str(cal), "calibrate", profile="cpu")
    assert load_profile("cpu", cal).prefill_step_tokens == load_profile("cpu").prefill_step_tokens  # served defaults


@pytest.mark.parametrize("name", ["h100-measured", "h200"])
def test_short_prompts_on_a_measured_gpu_profile_share_one_steps_fixed_cost(name):
    from services.sim.cluster import ClusterConfig, ClusterSim
    from services.sim.profiles import load_profile
    from services.sim.workloads import SimRequest

    profile = load_profile(name)
    block = profile.block_size
    # eight fresh 64-token prompts at once on one prefill worker
    reqs = [SimRequest(i, 0.0, "standard", list(range(1000 * i, 1000 * i + 64 // block)), 64, 2) for i in range(8)]
    sim = ClusterSim(ClusterConfig(profile, 1, 1, policy="round-robin", disaggregation="always", closed_loop=8), reqs)
    jobs = sim.run().jobs
    last = max(j.first_token_at for j in jobs)
    # the first arrival starts a step alone, the seven behind it share the next (plus the decode side's
    # step); not one prompt after another, which took 8 x ~27 ms on h100-measured
    two_steps = profile.prefill_s(64, 64) + profile.prefill_s(7 * 64, 64) + profile.transfer_s(64)
    assert last < two_steps + 2 * profile.decode_step_s(8, 8 * 64)
    assert last < 4 * profile.prefill_base_s
