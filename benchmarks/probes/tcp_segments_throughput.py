"""TCP KV transport throughput: this tree's kvtransfer/tcp.py against a git revision's, alternately.

The segmented payload framing (4 MiB segments, each behind a 4-byte length, so that a cancelled
send can be abandoned with the connection still in step) adds a small write and a small read per
segment. This probe measures what that costs: both ends in one process over loopback, one
message of ``--mib`` MiB at a time from a CPU tensor into a CPU tensor (as between two KV caches),
``--rounds`` rounds of ``--messages`` messages, the base revision and this tree alternating
(base, this, this, base, ...) so a drift in machine load falls on both.

    python benchmarks/probes/tcp_segments_throughput.py --base 76458d6 --json out.json

Timings on a shared machine are not of record: rerun it quietly.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvtransfer import tcp as this_tcp  # noqa: E402


def _module_at(rev: str):
    source = subprocess.run(["git", "show", f"{rev}:kvtransfer/tcp.py"], capture_output=True, text=True,
                            check=True).stdout
    path = Path(tempfile.mkdtemp()) / "tcp_base.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("kvtransfer.tcp_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def _gbps(module, src: torch.Tensor, dst: torch.Tensor, messages: int) -> float:
    transport, landed = module.TcpTransport(), asyncio.Queue()

    async def on_connection(conn):
        while True:
            try:
                header = await conn.recv()
            except Exception:  # noqa: BLE001 - the sender closed: done
                return
            await conn.recv_payload(header, [dst])
            await landed.put(None)

    listener = await transport.listen("127.0.0.1", 0, on_connection)
    conn = await transport.connect(listener.address, 5)
    await conn.send({"type": "warm-up"}, [src])
    await landed.get()
    started = time.perf_counter()
    for i in range(messages):
        await conn.send({"type": "x", "n": i}, [src])
        await landed.get()
    seconds = time.perf_counter() - started
    conn.close()
    await listener.close()
    return messages * src.numel() / seconds / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="git revision whose kvtransfer/tcp.py is the baseline")
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--messages", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4, help="each round: base, this, this, base")
    p.add_argument("--json", help="write the raw result here")
    args = p.parse_args()
    base = _module_at(args.base)
    src = torch.randint(0, 256, (args.mib << 20,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    runs: dict[str, list[float]] = {"base": [], "this": []}
    for _ in range(args.rounds):
        for name, module in (("base", base), ("this", this_tcp), ("this", this_tcp), ("base", base)):
            runs[name].append(round(asyncio.run(_gbps(module, src, dst, args.messages)), 3))
            print(name, runs[name][-1], "GB/s", flush=True)
    assert torch.equal(src, dst)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "probe": "benchmarks/probes/tcp_segments_throughput.py", "argv": sys.argv[1:], "commit": commit,
        "base": args.base, "message_mib": args.mib, "messages_per_run": args.messages,
        "machine": {"processor": platform.processor() or platform.machine(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "gbps": runs,
        "median_gbps": {k: round(statistics.median(v), 3) for k, v in runs.items()},
        "this_vs_base": round(statistics.median(runs["this"]) / statistics.median(runs["base"]), 3),
    }
    print(json.dumps({k: result[k] for k in ("median_gbps", "this_vs_base")}))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
