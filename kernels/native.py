"""CPU kernels in C (paged decode attention, bf16-weight linear, the small fused ops):
compiled once into one library with the system compiler, loaded with ctypes.

Why not a torch C++ extension: building against torch's headers takes minutes
on a small machine; this C file needs none and compiles in about a second.
ctypes releases the GIL during the call, and the OpenMP runtime it links
(libgomp.so.1) is the one torch has already loaded, so both share one thread
pool. The build is cached under ``$PDSERVE_CACHE_DIR/kernels`` keyed by the
source, the compiler and the CPU's flags (it is built with -march=native). If no
compiler is available, callers fall back to the torch references. Container
images carry prebuilt libraries instead (``prebuild``, ``PDSERVE_PREBUILT_KERNELS``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(n) for n in ("paged_attention_cpu.c", "linear_cpu.c", "fused_cpu.c")]
_HEADERS = [Path(__file__).with_name("cpu_simd.h")]
_STEM = "pdserve_cpu_kernels"
# -fno-math-errno lets gcc call the vector expf; no other fast-math (the kernels rely on -inf)
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c11"]


def _cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve")) / "kernels"


def _cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) found")
    return cc


def _source_digest() -> bytes:
    return b"".join(s.read_bytes() for s in _SOURCES + _HEADERS)


def _compile(cc: str, flags: list[str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    try:
        subprocess.run([cc, *flags, *map(str, _SOURCES), "-o", tmp, "-lm"], check=True, capture_output=True, text=True)
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would hide a prebuilt library from a container's non-root user
        os.replace(tmp, target)  # atomic: concurrent builders never see a half-written file
    except subprocess.CalledProcessError as exc:
        os.unlink(tmp)
        raise RuntimeError(f"compiling {' '.join(s.name for s in _SOURCES)} failed: {exc.stderr.strip()[:500]}") from None


def _build() -> Path:
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(_source_digest() + " ".join(_FLAGS).encode()
                         + version.encode() + _cpu_flags().encode()).hexdigest()[:16]
    target = _cache_dir() / f"{_STEM}-{key}.so"
    if target.is_file():
        return target
    _compile(cc, _FLAGS, target)
    for stale in target.parent.glob(f"{_STEM}-*.so"):
        if stale != target:
            stale.unlink(missing_ok=True)
    return target


# ---- prebuilt libraries (container images: no compiler at run time) ------------------
#
# -march=native ties a build to the CPU it ran on, so an image instead carries one
# library per x86-64 level, built by `python -m kernels.native --prebuild DIR` at image
# build time; with PDSERVE_PREBUILT_KERNELS=DIR, library() loads the first level whose
# CPU flags (/proc/cpuinfo names) this CPU has. The kernels' vector paths need AVX-512F
# (x86-64-v4); kernels that test other features (__AMX_BF16__, __AVX512BF16__) need a level of their
# own, first in the list, with its -m flags and the cpuinfo flags they mean.
PREBUILT_LEVELS: tuple[tuple[str, list[str], frozenset[str]], ...] = (
    ("x86-64-v4", ["-march=x86-64-v4"], frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"})),
    ("x86-64-v2", ["-march=x86-64-v2"], frozenset({"sse4_2", "popcnt", "ssse3"})),
)


def _levels() -> tuple[tuple[str, list[str], frozenset[str]], ...]:
    import platform

    if platform.machine() in ("x86_64", "AMD64"):
        return PREBUILT_LEVELS
    return (("generic", [], frozenset()),)  # aarch64 etc.: the portable C paths


def _prebuilt_name(level: str) -> str:
    return f"{_STEM}-{level}-{hashlib.sha256(_source_digest()).hexdigest()[:16]}.so"


def prebuild(directory: Path) -> list[Path]:
    """Build every level's library into ``directory`` (at image build time)."""
    cc = _compiler()
    flags = [f for f in _FLAGS if f != "-march=native"]
    built = []
    for level, march, _needs in _levels():
        target = directory / _prebuilt_name(level)
        _compile(cc, [*march, "-mtune=generic", *flags], target)
        built.append(target)
    return built


def _prebuilt(directory: Path) -> Path:
    have = set(_cpu_flags().split())
    for level, _march, needs in _levels():
        candidate = directory / _prebuilt_name(level)
        if needs <= have and candidate.is_file():
            return candidate
    raise RuntimeError(f"no prebuilt kernels in {directory} for these sources and this CPU")


@dataclass(frozen=True)
class Limits:
    """What the compiled kernels take, asked once (callers check shapes on every step)."""

    vector: bool  # built with AVX-512 (the tiled attention kernels, the projection kernel)
    max_group: int  # query heads per KV head, decode attention
    max_head_dim: int
    max_block_size: int  # decode attention


@lru_cache(maxsize=1)
def limits() -> Limits | None:
    lib = library()
    if lib is None:
        return None
    return Limits(bool(lib.pdserve_linear_available()), lib.pdserve_limits(0), lib.pdserve_limits(1),
                  lib.pdserve_limits(2))


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (with one warning) where they cannot be built."""
    if os.environ.get("PDSERVE_DISABLE_NATIVE_KERNELS"):
        return None
    try:
        import torch  # noqa: F401  (loads torch's libgomp first, so ours resolves to it)

        prebuilt = os.environ.get("PDSERVE_PREBUILT_KERNELS")
        lib = ctypes.CDLL(str(_prebuilt(Path(prebuilt)) if prebuilt else _build()))
    except (RuntimeError, OSError) as exc:
        log.warning("native CPU kernels unavailable (%s); using the torch references", exc)
        return None
    i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    for name in ("paged_decode_attention_f32", "paged_decode_attention_bf16"):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, i64,
                       i32, i32, i32, i32, i32, f32]
    for name in ("paged_prefill_attention_f32", "paged_prefill_attention_bf16"):
        fn = getattr(lib, name)
        fn.restype = i32
        fn.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, ptr, ptr, ptr, i64, i64,
                       i32, i32, i32, i32, i32, f32]
    lib.pdserve_limits.restype = i32
    lib.pdserve_limits.argtypes = [i32]
    lib.pdserve_linear_available.restype = i32
    lib.pdserve_linear_available.argtypes = []
    lib.pdserve_linear_bf16w.restype = i32
    lib.pdserve_linear_bf16w.argtypes = [ptr, i32, i64, ptr, ptr, ptr, i32, i64, i32, i32, i32]
    lib.pdserve_fused_available.restype = i32
    lib.pdserve_fused_available.argtypes = []
    lib.pdserve_rms_norm_bf16.restype = i32
    lib.pdserve_rms_norm_bf16.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, ptr, i64, i32, i32, f32]
    lib.pdserve_rotary_bf16.restype = i32
    lib.pdserve_rotary_bf16.argtypes = [ptr, i64, i64, i32, i32, i32, ptr, ptr, i64]
    lib.pdserve_silu_and_mul_bf16.restype = i32
    lib.pdserve_silu_and_mul_bf16.argtypes = [ptr, i64, ptr, i64, i32, i32]
    lib.pdserve_write_kv.restype = None
    lib.pdserve_write_kv.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, ptr, i32, i32, i32, i32]
    return lib


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "--prebuild":
        sys.exit("usage: python -m kernels.native --prebuild DIR")
    for path in prebuild(Path(sys.argv[2])):
        print(f"built {path}")
