"""What `pdserve up` chooses where its flags leave it open (services/up_defaults.py), and that flags win.

What a user notices: `pdserve up` with no flags on a 2-core machine runs 1 prefill + 1 decode
worker with every core as their threads and the GGUF file's own blocks, says so, and any flag
they give (or its PDSERVE_* variable) is what runs.
"""

from __future__ import annotations

import argparse

import pytest

from services import up, up_defaults
from services.launcher import LocalStack
from services.engine.model_source import default_model_path


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.add_parser(parser.add_subparsers())
    return parser.parse_args(["up", *flags])


SERVABLE = (True, "x.gguf's projections are Q4_1 blocks")


def test_two_cores_run_disaggregated_with_every_core_and_the_files_blocks():
    choice = up_defaults.choose(2, gguf=SERVABLE)
    assert (choice.prefill, choice.decode, choice.threads, choice.quantization) == (1, 1, 2, "gguf")
    assert choice.router_args == ["--local-prefill-max-tokens=256"]
    assert len(choice.reasons) == 6 and all(" because " in r for r in choice.reasons)
    assert not choice.front_first and choice.engine_nice == 19 and choice.realtime_gateway


def test_one_core_prefills_on_the_decode_worker():
    choice = up_defaults.choose(1, gguf=(False, "the model is not a .gguf file"))
    assert (choice.prefill, choice.decode, choice.threads, choice.quantization) == (0, 1, 1, None)
    assert choice.router_args == []  # no prefill worker: nothing to decide
    assert "not a .gguf" in choice.summary()


@pytest.mark.parametrize("cpus", [2, 16])
def test_threads_follow_the_cores_unless_given(cpus):
    assert up_defaults.choose(cpus, prefill=3, decode=2).threads == cpus
    assert up_defaults.choose(cpus, threads=1).threads == 1


def test_given_values_are_kept_and_not_explained():
    choice = up_defaults.choose(2, prefill=1, decode=2, threads=3, quantization="none", gguf=SERVABLE,
                                local_prefill_given=True, front_first=False, engine_nice=0, realtime_gateway=False)
    assert (choice.prefill, choice.decode, choice.threads, choice.quantization) == (1, 2, 3, None)
    assert choice.reasons == [] and choice.router_args == [] and not choice.front_first and choice.engine_nice == 0
    assert not choice.realtime_gateway


def test_flags_reach_the_stack_spec_unchanged():
    spec = up.spec_from_args(_args("--prefill", "1", "--threads", "1", "--quantization", "int8"))
    assert (spec.prefill, spec.decode, spec.threads, spec.quantization) == (1, 1, 1, "int8")
    spec = up.spec_from_args(_args("--prefill", "2", "--quantization", "none"))
    assert (spec.prefill, spec.quantization) == (2, None)
    # the router's threshold: chosen unless given through --router-arg (either spelling), given last
    assert up.spec_from_args(_args("--prefill", "1")).router_args == ["--local-prefill-max-tokens=256"]
    for given in (["--router-arg=--local-prefill-max-tokens=0"],
                  ["--router-arg=--local-prefill-max-tokens", "--router-arg=0"]):
        assert up.spec_from_args(_args("--prefill", "1", *given)).router_args == [g.split("=", 1)[1] for g in given]


def test_front_first_scheduling_is_off_unless_asked():
    args = _args("--quantization", "none")  # none: no model file to read
    assert not up.spec_from_args(args).front_first and "CPU slices" not in up.choice_from_args(args).summary()
    args = _args("--front-first", "--quantization", "none")
    assert up.spec_from_args(args).front_first and "0.1 ms CPU slices" in up.choice_from_args(args).summary()


def test_the_gateway_loop_is_real_time_unless_told_not_to():
    args = _args("--quantization", "none")
    spec = up.spec_from_args(args)
    assert spec.realtime_gateway and "real-time class" in up.choice_from_args(args).summary()
    assert "--realtime" in LocalStack(spec)._gateway_argv(0, -1, [])
    args = _args("--no-realtime-gateway", "--quantization", "none")  # given: kept, and not explained
    spec = up.spec_from_args(args)
    assert not spec.realtime_gateway and "real-time" not in up.choice_from_args(args).summary()
    assert "--realtime" not in LocalStack(spec)._gateway_argv(0, -1, [])


def test_the_engine_workers_yield_the_cores_to_the_front_door_unless_told_not_to():
    args = _args("--quantization", "none")
    assert up.spec_from_args(args).engine_nice == 19 == up_defaults.ENGINE_NICE
    assert "autogroups at niceness 19" in up.choice_from_args(args).summary()
    args = _args("--engine-nice", "0", "--quantization", "none")  # given: kept, and not explained
    assert up.spec_from_args(args).engine_nice == 0 and "niceness" not in up.choice_from_args(args).summary()
    for bad in ("-5", "20", "high"):
        with pytest.raises(SystemExit):
            _args("--engine-nice", bad)


def test_a_pdserve_variable_counts_as_given(monkeypatch):
    from services import cli, env_defaults

    parser = cli.build_parser(["up"])
    env_defaults.apply(parser, {"PDSERVE_PREFILL": "1", "PDSERVE_QUANTIZATION": "none"})
    args = parser.parse_args(["up"])
    spec = up.spec_from_args(args)
    assert spec.prefill == 1 and spec.quantization is None


def test_the_default_model_file_is_served_from_its_blocks():
    ok, why = up_defaults.gguf_servable(default_model_path())
    assert ok, why
    assert up.spec_from_args(_args()).quantization == "gguf"


def test_a_file_that_is_not_gguf_keeps_unquantized_weights(tmp_path):
    assert up_defaults.gguf_servable(None)[0] is False
    assert up_defaults.gguf_servable(tmp_path / "model")[0] is False
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    ok, why = up_defaults.gguf_servable(broken)
    assert not ok and "could not be read" in why
    spec = up.spec_from_args(_args("--model", str(tmp_path)))
    assert spec.quantization is None


def test_the_servable_block_types_are_the_kernels():
    from kernels.gguf_linear import KINDS

    assert set(up_defaults.GGUF_SERVABLE) == set(KINDS)


def test_bench_frontdoor_measures_the_stack_pdserve_up_chooses():
    # its figures are quoted as `pdserve up`'s: it ran a bf16 stack at the kernel's scheduling before,
    # while `pdserve up` chose GGUF weights, local prefill and the workers' autogroups at niceness 19
    from services.cli import build_parser
    from services.gateway import frontdoor_bench

    def bench(*flags: str) -> up_defaults.Choice:
        return frontdoor_bench._up_choice(build_parser(["bench", "frontdoor"]).parse_args(["bench", "frontdoor",
                                                                                            *flags]))

    for bench_flags, up_flags in (((), ()), (("--engine-nice", "0", "--front-first"), ("--engine-nice", "0",
                                                                                         "--front-first"))):
        ours, theirs = bench(*bench_flags), up.choice_from_args(_args(*up_flags))
        assert (ours.prefill, ours.decode, ours.threads, ours.quantization, ours.router_args, ours.engine_nice,
                ours.front_first) == (theirs.prefill, theirs.decode, theirs.threads, theirs.quantization,
                                      theirs.router_args, theirs.engine_nice, theirs.front_first)
    assert bench().engine_nice == up_defaults.ENGINE_NICE


def test_stream_flags_reach_the_decode_workers_and_both_at_once_are_refused():
    # nothing given: the workers' own default (a 20 ms flush, stream_holding.py), so no flag is passed
    assert up.spec_from_args(_args("--prefill", "1")).decode_args == []
    assert up.spec_from_args(_args("--prefill", "1", "--stream-interval", "1")).decode_args == ["--stream-interval=1"]
    assert up.spec_from_args(_args("--prefill", "1", "--stream-flush-ms", "0")).decode_args == ["--stream-flush-ms=0"]
    with pytest.raises(ValueError, match="give one"):
        up.spec_from_args(_args("--prefill", "1", "--stream-interval", "4", "--stream-flush-ms", "10"))
    with pytest.raises(SystemExit):  # argparse: a flush past a second is not a stream
        _args("--stream-flush-ms", "5000")
