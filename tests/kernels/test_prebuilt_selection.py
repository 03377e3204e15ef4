"""Prebuilt CPU kernels (container images): the best level this CPU runs is chosen, never one it cannot."""

from __future__ import annotations

import pytest

from kernels import native


@pytest.fixture
def levels_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(native, "_levels", lambda: native.PREBUILT_LEVELS)
    for level, _march, _needs in native.PREBUILT_LEVELS:
        (tmp_path / native._prebuilt_name(level)).write_bytes(b"")
    return tmp_path


def _pick(monkeypatch, directory, flags: str) -> str:
    monkeypatch.setattr(native, "_cpu_flags", lambda: f"flags\t\t: {flags}")
    return native._prebuilt(directory).name


def test_the_most_capable_level_the_cpu_has(levels_dir, monkeypatch):
    avx512 = "sse4_2 popcnt ssse3 avx2 avx512f avx512bw avx512dq avx512vl avx512cd"
    assert "-x86-64-v4-" in _pick(monkeypatch, levels_dir, avx512 + " avx512_bf16 amx_tile")
    # no AVX-512 (a laptop, an AMD Zen 3): the AVX-512 build would die of SIGILL at its first vector op
    assert "-x86-64-v2-" in _pick(monkeypatch, levels_dir, "sse4_2 popcnt ssse3 avx2")
    assert "-x86-64-v2-" in _pick(monkeypatch, levels_dir, "sse4_2 popcnt ssse3 avx2 avx512f")  # F alone is not v4


def test_libraries_of_other_sources_are_not_loaded(tmp_path, monkeypatch):
    monkeypatch.setattr(native, "_levels", lambda: native.PREBUILT_LEVELS)
    for level, _march, _needs in native.PREBUILT_LEVELS:  # built from other kernel sources (a stale image)
        (tmp_path / f"pdserve_cpu_kernels-{level}-{'0' * 16}.so").write_bytes(b"")
    with pytest.raises(RuntimeError, match="no prebuilt kernels"):
        _pick(monkeypatch, tmp_path, "sse4_2 popcnt ssse3 avx512f avx512bw avx512dq avx512vl avx512cd")
