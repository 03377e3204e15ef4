"""Choosing the CPU kernel level: the best this CPU has, a lower one when forced, a clear error
for one it cannot run, and each level's library built for that level only."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kernels import cpu_isa, native


def test_levels_this_cpu_can_run_start_at_generic_and_end_at_the_best():
    have = cpu_isa.available()
    assert have[0] == "generic" and have[-1] == cpu_isa.best()
    assert have == list(cpu_isa.LEVELS[: len(have)])


def test_each_level_loads_a_library_built_for_exactly_that_level():
    for level in cpu_isa.available():
        lib = native._library(level)
        assert lib is not None, level
        assert cpu_isa.LEVELS[lib.pdserve_isa_level()] == level
        # the AVX-512 kernels exist from the avx512 level up, never below
        assert bool(lib.pdserve_linear_available()) == cpu_isa.at_least("avx512", level)


def test_forcing_a_level_switches_the_kernels_and_back():
    best = cpu_isa.best()
    previous = cpu_isa.force("avx2" if "avx2" in cpu_isa.available() else "generic")
    try:
        assert native.level() in ("avx2", "generic") and not native.limits().vector
    finally:
        cpu_isa.force(previous)
    assert cpu_isa.selected() == best


def test_unknown_or_unavailable_levels_are_clear_errors():
    with pytest.raises(ValueError, match="unknown CPU kernel level 'sse9'"):
        cpu_isa.force("sse9")
    above = cpu_isa.LEVELS[cpu_isa.LEVELS.index(cpu_isa.best()) + 1:]
    for level in above:
        with pytest.raises(ValueError, match=f"cannot run the {level} kernels"):
            cpu_isa.check(level)


def test_the_environment_variable_selects_the_level_in_a_fresh_process():
    code = "from kernels import native; print(native.level())"
    out = subprocess.run([sys.executable, "-c", code], env={**_env(), cpu_isa.ENV: "generic"},
                         capture_output=True, text=True, timeout=300, check=True).stdout.strip()
    assert out == "generic"
    bad = subprocess.run([sys.executable, "-m", "services.cli", "generate", "--prompt", "hi", "--max-tokens", "1"],
                         env={**_env(), cpu_isa.ENV: "sse9"}, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "unknown CPU kernel level 'sse9'" in bad.stderr and "Traceback" not in bad.stderr


def _env() -> dict:
    import os

    return dict(os.environ)
