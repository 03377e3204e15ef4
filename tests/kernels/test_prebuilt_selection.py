"""Prebuilt CPU kernels (container images, no compiler at run time): every level's library is
built ahead, the selected level's (the best this CPU runs, or PDSERVE_CPU_ISA's) is loaded,
never one built from other sources."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpu_isa, native

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("prebuilt")
    built = native.prebuild(directory)
    assert sorted(p.name for p in built) == sorted(native._prebuilt_name(level) for level in cpu_isa.LEVELS)
    assert all(os.stat(p).st_mode & 0o005 == 0o005 for p in built)  # readable by a container's other user
    return directory


def _load(directory: Path, tmp_path: Path, level: str | None) -> dict:
    """native.library() in a fresh process with no compiler and an empty build cache."""
    env = {**os.environ, "PDSERVE_PREBUILT_KERNELS": str(directory), "CC": "/nonexistent/cc",
           "PDSERVE_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    env.pop(cpu_isa.ENV, None)
    if level is not None:
        env[cpu_isa.ENV] = level
    code = ("import json; from kernels import native; lib = native.library(); "
            "print(json.dumps({'name': lib and lib._name, 'level': native.level()}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout)


def test_the_best_level_is_loaded_without_a_compiler(prebuilt, tmp_path):
    got = _load(prebuilt, tmp_path, None)
    assert got["level"] == cpu_isa.best()
    assert Path(got["name"]).name == native._prebuilt_name(cpu_isa.best())


def test_a_forced_lower_level_loads_its_own_library(prebuilt, tmp_path):
    got = _load(prebuilt, tmp_path, "generic")
    assert got["level"] == "generic" and Path(got["name"]).name == native._prebuilt_name("generic")


def test_libraries_of_other_sources_are_not_loaded(tmp_path):
    for level in cpu_isa.LEVELS:  # built from other kernel sources (a stale image)
        (tmp_path / f"pdserve_cpu_kernels-{level}-{'0' * 16}.so").write_bytes(b"")
    with pytest.raises(RuntimeError, match="no prebuilt"):
        native._prebuilt(tmp_path, cpu_isa.best())
    # a process with only those falls back to the torch references, with a warning, not a crash
    assert _load(tmp_path, tmp_path / "cache", None) == {"name": None, "level": None}
