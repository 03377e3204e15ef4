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
