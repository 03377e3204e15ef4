"""Run pytest targets N times each while a busy loop holds one core, and save the pass counts.

For flaky tests that fail only on a loaded machine (the KV hand-off over TCP: test_profile_stack
failed 1 in a full local run beside a simulation, passed alone). The load is one Python busy loop
pinned to core 0 (``taskset``), the kind of load a simulation puts on a 2-core machine, at this
process's own priority, as the tests are: run it at idle priority on a shared machine, so that the
loop competes with the tests and not with anyone's latency measurement. The load average at the
start and the end is recorded: on a shared machine the other jobs are part of the load.

    python benchmarks/probes/tests_under_load.py --runs 5 \\
        tests/services/test_profile_stack.py tests/kvtransfer/test_kvtransfer_processes.py

Writes benchmarks/results/tests-under-load-<UTC stamp>.json after every run: per target, each
run's exit status, seconds, pytest's summary line, and a failed run's last output.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("targets", nargs="+", help="pytest targets (files or node ids)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--no-load", action="store_true", help="no busy loop (the quiet baseline)")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    load = None
    if not args.no_load:
        load = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", "while True: pass"])
    started, load_avg_at_start = dt.datetime.now(dt.timezone.utc), os.getloadavg()
    out = Path(args.out) / f"tests-under-load-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    results: dict[str, list[dict]] = {t: [] for t in args.targets}
    try:
        for i in range(args.runs):
            for target in args.targets:
                t0 = time.monotonic()
                proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", target],
                                      capture_output=True, text=True)
                lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
                summary = lines[-1] if lines else proc.stderr[-300:]
                failures = [ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
                results[target].append({"run": i + 1, "rc": proc.returncode, "seconds": round(time.monotonic() - t0, 1),
                                        "summary": summary, "failures": failures,
                                        # what a failed run printed last (the tests print their diagnostics)
                                        "output_tail": proc.stdout[-6000:] if proc.returncode else ""})
                print(f"run {i + 1} {target}: rc={proc.returncode} {summary}", flush=True)
                _save(out, args, started, load_avg_at_start, load, results)  # kept even if stopped early
    finally:
        if load is not None:
            load.kill()
            load.wait()
    print(out)


def _save(out: Path, args, started, load_avg_at_start, load, results) -> None:
    report = {
        "probe": "benchmarks/probes/tests_under_load.py",
        "argv": sys.argv[1:],
        "commit": _commit(),
        "started": started.isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "nice": os.nice(0),
                    "load_avg_at_start": load_avg_at_start, "load_avg_at_save": os.getloadavg()},
        "load": None if load is None else "one busy loop on core 0 (taskset -c 0) at this process's nice",
        "runs_done": min(len(r) for r in results.values()),
        "passed_runs": {t: sum(r["rc"] == 0 for r in runs) for t, runs in results.items()},
        "runs": results,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
