"""CPU kernels in C (paged attention, linear layers over bf16 / int8 / GGUF-block weights, the
small fused ops): compiled into one library per instruction-set level with the system
compiler, loaded with ctypes, the level chosen at run time from what the CPU has.

Why not a torch C++ extension: building against torch's headers takes minutes
on a small machine; these C files need none and compile in a few seconds.
ctypes releases the GIL during the call, and the OpenMP runtime it links
(libgomp.so.1) is the one torch has already loaded, so both share one thread
pool. Builds are cached under ``$PDSERVE_CACHE_DIR/kernels`` keyed by the
source, the compiler and the level's flags. If no compiler is available,
callers fall back to the torch references. Container
images carry every level's library prebuilt instead (``prebuild``, ``PDSERVE_PREBUILT_KERNELS``).

Levels (kernels/cpu_isa.py): the best the CPU has, or ``PDSERVE_CPU_ISA=<level>`` to force
a lower one (tests run every level the machine can). Each level's library is built for that
level only (``-march=x86-64-v3``, ``-v4`` plus extensions), never ``-march=native``, so what
runs is what the level names.
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

from kernels import cpu_isa

log = logging.getLogger(__name__)

# each source and the highest level whose instructions it uses: a level's library is these
# objects, each compiled at min(level, its cap), so levels share the objects they have in common
# (the attention kernels take ~30 s to compile; built once, not once per level)
_SOURCES = {
    "paged_attention_cpu.c": "avx512",
    "fused_cpu.c": "avx512",
    "linear_cpu.c": "avx512",
    "linear_amx.c": "amx",
    "linear_quant.c": "avx512_vnni",
    "cpu_features.c": "amx",
    "decode_layers_cpu.c": "avx512",
    "lora_cpu.c": "avx512_vnni",
}
_HEADERS = [Path(__file__).with_name(n) for n in ("cpu_simd.h", "linear_pack.h")]
_STEM = "pdserve_cpu_kernels"
# -fno-math-errno lets gcc call the vector expf; no other fast-math (the kernels rely on -inf)
_FLAGS = ["-O3", "-mtune=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-std=gnu11"]


def _cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve")) / "kernels"


def _run_atomic(cmd: list[str], target: Path, what: str) -> None:
    """Run ``cmd`` writing a temp file (its last argument), then move it to ``target`` at once:
    concurrent builders never see a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=target.suffix)
    os.close(fd)
    try:
        subprocess.run([*cmd, tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    except subprocess.CalledProcessError as exc:
        os.unlink(tmp)
        raise RuntimeError(f"{what} failed: {exc.stderr.strip()[:500]}") from None
    for stale in target.parent.glob(target.name.rsplit("-", 1)[0] + "-*" + target.suffix):
        if stale != target:
            stale.unlink(missing_ok=True)


def _build(level: str) -> Path:
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.encode()
    headers = b"".join(h.read_bytes() for h in _HEADERS)
    directory = _cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    objects = []
    for name, cap in _SOURCES.items():
        src = Path(__file__).with_name(name)
        at = cpu_isa.LEVELS[min(cpu_isa.LEVELS.index(level), cpu_isa.LEVELS.index(cap))]
        flags = _FLAGS + cpu_isa.compiler_flags(at)
        key = hashlib.sha256(src.read_bytes() + headers + " ".join(flags).encode() + version).hexdigest()[:16]
        obj = directory / f"{_STEM}-{src.stem}-{at}-{key}.o"
        if not obj.is_file():
            _run_atomic([cc, *flags, "-c", str(src), "-o"], obj, f"compiling {name} for {at}")
        objects.append(obj)
    key = hashlib.sha256(" ".join(o.name for o in objects).encode()).hexdigest()[:16]
    target = directory / f"{_STEM}-{level}-{key}.so"
    if not target.is_file():
        _run_atomic([cc, "-shared", "-fopenmp", *map(str, objects), "-lm", "-o"], target, f"linking the {level} kernels")
    return target


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) found")
    return cc


# ---- prebuilt libraries (container images: no compiler at run time) ------------------
#
# An image carries every level's library, built by `python -m kernels.native --prebuild DIR`
# at image build time (each level's flags name exactly that level, so the libraries run on
# any CPU of their level); with PDSERVE_PREBUILT_KERNELS=DIR the library of the selected level
# (kernels/cpu_isa.py: the best this CPU has) is loaded from there. A library's name carries
# the digest of the sources it was built from, so a stale image's kernels are never loaded.
def _prebuilt_name(level: str) -> str:
    digest = b"".join(Path(__file__).with_name(n).read_bytes() for n in _SOURCES)
    digest += b"".join(h.read_bytes() for h in _HEADERS)
    return f"{_STEM}-{level}-{hashlib.sha256(digest).hexdigest()[:16]}.so"


def prebuild(directory: Path) -> list[Path]:
    """Build every level's library into ``directory`` (at image build time)."""
    directory.mkdir(parents=True, exist_ok=True)
    built = []
    for name in cpu_isa.LEVELS:
        target = directory / _prebuilt_name(name)
        shutil.copyfile(_build(name), target)
        os.chmod(target, 0o755)  # readable by a container's non-root user
        built.append(target)
    return built


def _prebuilt(directory: Path, level: str) -> Path:
    candidate = directory / _prebuilt_name(level)
    if not candidate.is_file():
        raise RuntimeError(f"no prebuilt {level} kernels in {directory} for these sources")
    return candidate


@dataclass(frozen=True)
class Limits:
    """What the compiled kernels take, asked once (callers check shapes on every step)."""

    vector: bool  # built with AVX-512 (the tiled attention kernels, the projection kernel)
    max_group: int  # query heads per KV head, decode attention
    max_head_dim: int
    max_block_size: int  # decode attention


def limits() -> Limits | None:
    return _limits(cpu_isa.selected())


@lru_cache(maxsize=None)
def _limits(level: str) -> Limits | None:
    lib = _library(level)
    if lib is None:
        return None
    return Limits(bool(lib.pdserve_linear_available()), lib.pdserve_limits(0), lib.pdserve_limits(1),
                  lib.pdserve_limits(2))


def library() -> ctypes.CDLL | None:
    """The compiled kernels of the selected level (kernels/cpu_isa.py), or None (with one
    warning) where they cannot be built."""
    return _library(cpu_isa.selected())


def level() -> str | None:
    """The level of the kernels that run (None: the torch references)."""
    return cpu_isa.selected() if library() is not None else None


@lru_cache(maxsize=None)
def _library(level: str) -> ctypes.CDLL | None:
    if os.environ.get("PDSERVE_DISABLE_NATIVE_KERNELS"):
        return None
    try:
        import torch  # noqa: F401  (loads torch's libgomp first, so ours resolves to it)

        prebuilt = os.environ.get("PDSERVE_PREBUILT_KERNELS")
        lib = ctypes.CDLL(str(_prebuilt(Path(prebuilt), level) if prebuilt else _build(level)))
    except (RuntimeError, OSError) as exc:
        log.warning("native CPU kernels unavailable (%s); using the torch references", exc)
        return None
    if lib.pdserve_isa_level() != cpu_isa.LEVELS.index(level):
        raise RuntimeError(f"the {level} kernels were built for level {cpu_isa.LEVELS[lib.pdserve_isa_level()]}")
    i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    for name in ("paged_decode_attention_f32", "paged_decode_attention_bf16"):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, i64,
                       i32, i32, i32, i32, i32, f32]
    lib.paged_decode_attention_bf16_i8kv.restype = i32
    lib.paged_decode_attention_bf16_i8kv.argtypes = lib.paged_decode_attention_bf16.argtypes
    for name in ("paged_prefill_attention_f32", "paged_prefill_attention_bf16", "paged_prefill_attention_bf16_i8kv"):
        fn = getattr(lib, name)
        fn.restype = i32
        fn.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, ptr, ptr, ptr, i64, i64,
                       i32, i32, i32, i32, i32, f32]
    lib.pdserve_limits.restype = i32
    lib.pdserve_limits.argtypes = [i32]
    lib.pdserve_linear_available.restype = i32
    lib.pdserve_linear_available.argtypes = []
    for name in ("pdserve_linear_packed", "pdserve_linear_packed_portable"):
        fn = getattr(lib, name)
        fn.restype = i32
        fn.argtypes = [ptr, i32, i64, ptr, i32, ptr, ptr, ptr, i32, i64, i32, i32, i32]
    for name in ("pdserve_linear_gguf", "pdserve_linear_gguf_portable"):
        fn = getattr(lib, name)
        fn.restype = i32
        fn.argtypes = [ptr, i32, i64, ptr, i32, ptr, i32, i64, i32, i32, i32]
    lib.pdserve_gguf_dequantize.restype = None
    lib.pdserve_gguf_dequantize.argtypes = [ptr, i32, ptr, i32, i32]
    lib.pdserve_fused_available.restype = i32
    lib.pdserve_fused_available.argtypes = []
    lib.pdserve_rms_norm_bf16.restype = i32
    lib.pdserve_rms_norm_bf16.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, ptr, i64, i32, i32, f32]
    lib.pdserve_rotary_bf16.restype = i32
    lib.pdserve_rotary_bf16.argtypes = [ptr, i64, i64, i32, i32, i32, ptr, ptr, i64]
    lib.pdserve_silu_and_mul_bf16.restype = i32
    lib.pdserve_silu_and_mul_bf16.argtypes = [ptr, i64, ptr, i64, i32, i32]
    lib.pdserve_write_kv_int8.restype = None
    lib.pdserve_write_kv_int8.argtypes = [ptr, i64, ptr, i64, i32, ptr, ptr, i64, i64, ptr, i32, i32, i32, i32]
    lib.pdserve_write_kv.restype = None
    lib.pdserve_write_kv.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, ptr, i32, i32, i32, i32]
    lib.pdserve_lora_available.restype = i32
    lib.pdserve_lora_available.argtypes = []
    lib.pdserve_lora.restype = i32
    lib.pdserve_lora.argtypes = [ptr, i64, ptr, i64, i32, i32, i32, ptr, ptr, i32, i32, ptr, ptr, ptr, i32, ptr, ptr]
    lib.pdserve_decode_layers.restype = i32
    lib.pdserve_decode_layers.argtypes = [ptr, ptr, ptr, i32, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr]
    return lib


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "--prebuild":
        sys.exit("usage: python -m kernels.native --prebuild DIR")
    for path in prebuild(Path(sys.argv[2])):
        print(f"built {path}")
