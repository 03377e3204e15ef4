"""Which instruction-set level the CPU kernels run at: the best this CPU has, or a lower one
when asked (``PDSERVE_CPU_ISA``, or ``force`` in tests).

Levels, each including the ones before it, and what each adds to the kernels:

    generic      portable C (any CPU gcc targets); torch references for the rest
    avx2         the portable C vectorised for AVX2 + FMA (x86-64-v3): the fallback
    avx512       AVX-512 F/BW/VL/DQ (x86-64-v4): tiled attention, packed-panel projections
    avx512_vnni  + VNNI: int8 dot products (vpdpbusd) for GGUF-block weights
    avx512_bf16  + AVX512_BF16: bf16 dot products (vdpbf16ps)
    amx          + AMX tiles (bf16 and int8): projections of many rows on the tile unit

AMX needs the kernel's permission for the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``),
asked here once; where it is refused the level stays below. Nothing here imports torch.
"""

from __future__ import annotations

import ctypes
import os
import platform
from functools import lru_cache

LEVELS = ("generic", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx")
ENV = "PDSERVE_CPU_ISA"

# /proc/cpuinfo flags a level needs (on top of the previous level's)
_NEEDS = {
    "generic": set(),
    "avx2": {"avx2", "fma", "f16c", "bmi2"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"},
    "avx512_vnni": {"avx512_vnni"},
    "avx512_bf16": {"avx512_bf16"},
    "amx": {"amx_tile", "amx_bf16", "amx_int8"},
}
# compiler flags of each level's library: exactly the level, never -march=native
_FLAGS = {
    "generic": [],
    "avx2": ["-march=x86-64-v3"],
    "avx512": ["-march=x86-64-v4"],
    "avx512_vnni": ["-march=x86-64-v4", "-mavx512vnni"],
    "avx512_bf16": ["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"],
    "amx": ["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mamx-int8"],
}

_forced: str | None = None
_default: str | None = None  # $PDSERVE_CPU_ISA's level, or the best: set on first use


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _amx_permitted() -> bool:
    """Ask Linux for the AMX tile state (needed before the first tile instruction)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0
    except (OSError, AttributeError):
        return False


@lru_cache(maxsize=1)
def best() -> str:
    """The highest level this CPU (and kernel) can run."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return "generic"
    have, level = cpu_flags(), "generic"
    for name in LEVELS[1:]:
        if not _NEEDS[name] <= have:
            break
        if name == "amx" and not _amx_permitted():
            break
        level = name
    return level


def check(level: str) -> str:
    """``level`` if this CPU can run it, else ValueError naming what it can."""
    if level not in LEVELS:
        raise ValueError(f"unknown CPU kernel level {level!r}; expected one of {', '.join(LEVELS)}")
    if LEVELS.index(level) > LEVELS.index(best()):
        raise ValueError(f"this CPU cannot run the {level} kernels; it runs up to {best()} "
                         f"({', '.join(LEVELS[: LEVELS.index(best()) + 1])})")
    return level


def selected() -> str:
    """The level in use: ``force``'s, else ``$PDSERVE_CPU_ISA`` (read once per process: every
    kernel call asks, hundreds of times per engine step), else the best."""
    global _default
    if _forced is not None:
        return _forced
    if _default is None:
        _default = _from_env(os.environ.get(ENV) or None)
    return _default


@lru_cache(maxsize=8)
def _from_env(value: str | None) -> str:  # every kernel call asks: checked once per value
    return check(value) if value else best()


def force(level: str | None) -> str | None:
    """Run at ``level`` from now on (None: back to the default); returns the previous override.
    For tests and benches that compare levels in one process."""
    global _forced
    previous = _forced
    _forced = None if level is None else check(level)
    return previous


def at_least(level: str, current: str | None = None) -> bool:
    return LEVELS.index(current or selected()) >= LEVELS.index(level)


def available() -> list[str]:
    """Every level this CPU can run, lowest first."""
    return list(LEVELS[: LEVELS.index(best()) + 1])


def compiler_flags(level: str) -> list[str]:
    return list(_FLAGS[level])
