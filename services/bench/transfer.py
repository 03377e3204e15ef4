"""``pdserve bench kvtransfer``: GB/s of moving a prompt's KV between two processes.

This process is the sender (prefill side); a spawned child is the receiver
(decode side) with its own KV cache, running a UCX and a TCP ``Receiver`` over
one block pool, plus a raw ucxx listener. For each prompt size the three
paths are measured in rotating order within each round (so a noisy neighbour
hurts them alike) and the median is reported:

- ``ucx`` / ``tcp``: pdserve's path, as the engine drives it: the receiver
  reserves blocks, the sender writes them in prefill-sized chunks
  (``--chunk-tokens``), one after another, then ``finish``; the time runs from
  the first chunk until ``finish`` has the receiver's confirmation.
- ``raw``: one plain ucxx tag send of a single contiguous buffer of the same
  size into the receiver's cache (``Endpoint.send`` / ``recv``, awaited the
  ucxx way), until a one-byte acknowledgement is back: what UCX does for one
  message, to compare against.

Both UCX paths run with pdserve's UCX settings and progress driver
(``kvtransfer/ucx.py``, ``kvtransfer/ucx_progress.py``; override them through the environment):
with them, one large tag message is a single copy that the receiver pulls.
pdserve's ``ucx`` path can beat ``raw``: it also has the sender put part of
each chunk at the same time (``kvtransfer/ucx_puts.py``) and waits without polling. The
first measured round of each size checks that the receiver's blocks hold
exactly the sender's bytes. The JSON also records the 1-minute load average
before and after the run: on a shared 2-core machine the figures mean little
when it is above 1. Goal (issue 3): at 8k tokens ucx >= 60% of raw and >= 2x
tcp.

CLI wiring: ``add_arguments(subparser)`` then ``run(args)`` for the result
dict, or ``main(argv)`` for the whole command (table, or ``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

from kvtransfer.block_runs import BlockBytes
from kvtransfer.config import TransferConfig
from kvtransfer.descriptor import TransferDescriptor
from kvtransfer.sender import Sender
from services.bench.transfer_peer import NAMESPACE, RAW_ACK_TAG, RAW_DATA_TAG, digest, receiver_process
from services.engine.kv_cache import KVCacheSpec, allocate_kv_cache

# The default model, SmolLM2-135M: 30 layers, 3 KV heads of 64, bf16, blocks of
# 16 tokens -> 368,640 bytes per block.
DEFAULT_SPEC = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="bfloat16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", default="1024,8192,32768", help="prompt sizes in tokens, comma-separated")
    p.add_argument("--chunk-tokens", type=int, default=2048, help="tokens per send_blocks call (prefill chunk)")
    p.add_argument("--repeats", type=int, default=5, help="measured rounds per size (after one warm-up)")
    p.add_argument("--transports", default="ucx,tcp", help="pdserve transports to measure")
    p.add_argument("--device", default="cpu", help="where both KV caches live: cpu or cuda")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--peer", default=None, metavar="HOST:PORT",
                   help="use the receiver another process serves (--serve-peer), e.g. in another container, "
                        "instead of spawning one here")
    p.add_argument("--serve-peer", default=None, metavar="HOST:PORT",
                   help="be the receiving side for one --peer run, listening here, then exit")


def add_parser(sub) -> None:
    """Registers ``pdserve bench kvtransfer``."""
    p = sub.add_parser("kvtransfer", help="KV block transfer between two processes: UCX vs TCP vs raw ucxx",
                       description=__doc__.split("\n")[0])
    add_arguments(p)
    p.set_defaults(func=run_cli)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench kvtransfer", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run_cli(p.parse_args(argv))


def run_cli(args: argparse.Namespace) -> int:
    from services.bench import results as result_files

    if args.serve_peer:
        serve_peer(args.serve_peer)
        return 0
    result = run(args)
    result_files.report("kvtransfer", result, args, print_table)
    return 0 if result["verified"] else 1


def run(args: argparse.Namespace) -> dict:
    """Runs the benchmark; returns the JSON-able result (progress goes to stderr)."""
    sizes = [int(t) for t in str(args.tokens).split(",") if t]
    transports = [t for t in str(args.transports).split(",") if t]
    if not sizes or min(sizes) < 1 or args.chunk_tokens < 1 or args.repeats < 1:
        raise ValueError("tokens, chunk-tokens and repeats must be positive")
    ucx_ok, why = _ucx_available()
    if not ucx_ok:
        _progress(f"UCX unavailable ({why}): measuring TCP only")
        transports = [t for t in transports if t != "ucx"]
    paths = transports + (["raw"] if ucx_ok else [])
    load_before = os.getloadavg()[0]
    result = asyncio.run(_run(sizes, args.chunk_tokens, args.repeats, transports, paths, why, args.device,
                              getattr(args, "peer", None)))
    result["loadavg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    result["peer"] = getattr(args, "peer", None) or "spawned child process"
    return result


# The receiver in another process that was started on its own (``--serve-peer``), e.g. in another
# container: the same commands as the spawned child's pipe, over a multiprocessing connection (pickle,
# with a fixed key: a benchmark tool for a private network, not a service).
_PEER_KEY = b"pdserve-bench-kvtransfer"


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def serve_peer(address: str) -> None:
    """Serve one benchmark run as the receiver (decode side), then return."""
    from multiprocessing.connection import Listener

    from services.advertise import advertised_host

    host, port = _split(address)
    with Listener((host, port), authkey=_PEER_KEY) as listener:
        _progress(f"receiver waiting for a --peer run on {host}:{listener.address[1]}")
        with listener.accept() as conn:
            setup = conn.recv()
            receiver_process(conn, *setup, host=host, advertise=advertised_host(host))


def _connect_peer(address: str, setup: tuple):
    from multiprocessing.connection import Client

    conn = Client(_split(address), authkey=_PEER_KEY)
    conn.send(setup)
    return conn


async def _run(sizes, chunk_tokens, repeats, transports, paths, ucx_why, device, peer=None) -> dict:
    spec = DEFAULT_SPEC
    blocks_for = {n: -(-n // spec.block_size) for n in sizes}
    num_blocks = max(blocks_for.values()) + 1
    kv = allocate_kv_cache(spec, num_blocks)
    kv.view(-1).view(torch.uint8).random_(generator=torch.Generator().manual_seed(0))
    kv = kv.to(device)
    setup = (spec, num_blocks, transports, "raw" in paths, device)
    child = None
    if peer:
        parent_end = _connect_peer(peer, setup)
    else:
        ctx = mp.get_context("spawn")
        parent_end, child_end = ctx.Pipe()
        child = ctx.Process(target=receiver_process, args=(child_end, *setup))
        child.start()
    loop = asyncio.get_running_loop()
    call = lambda *msg: loop.run_in_executor(None, _ask, parent_end, msg)
    try:
        addresses = await call("addresses")
        senders = {t: Sender(kv, NAMESPACE, TransferConfig(transport=t)) for t in transports}
        raw_host = _split(peer)[0] if peer else "127.0.0.1"
        raw_ep = await _raw_connect(addresses["raw"], raw_host) if "raw" in paths else None
        samples: dict[int, dict[str, list[float]]] = {n: {p: [] for p in paths} for n in sizes}
        verified = True
        for n in sizes:
            nbytes = blocks_for[n] * spec.block_bytes
            for rnd in range(repeats + 1):  # round 0 warms up connections and caches
                for i in range(len(paths)):
                    path = paths[(rnd + i) % len(paths)]
                    check = rnd == 1
                    if path == "raw":
                        seconds = await _raw_once(raw_ep, call, kv, spec, nbytes)
                    else:
                        seconds, ok = await _pdserve_once(
                            senders[path], call, path, n, blocks_for[n], chunk_tokens, kv, spec, check
                        )
                        verified &= ok
                    if rnd:
                        samples[n][path].append(nbytes / seconds / 1e9)
                        _progress(f"{path:>3} {_label(n):>4} round {rnd}/{repeats}: {nbytes / seconds / 1e9:6.2f} GB/s")
        for s in senders.values():
            await s.close()
        if raw_ep is not None:
            await raw_ep.close()
        await call("stop")
    finally:
        if child is not None:
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
        else:
            parent_end.close()
    return _summary(spec, sizes, blocks_for, chunk_tokens, repeats, samples, verified, ucx_why, str(kv.device))


async def _pdserve_once(sender, call, path, tokens, nblocks, chunk_tokens, kv, spec, check) -> tuple[float, bool]:
    tid = f"{path}-{tokens}-{time.monotonic_ns()}"
    desc = TransferDescriptor.from_bytes(await call("reserve", path, tid, nblocks))
    src = list(range(1, nblocks + 1))
    step = max(1, chunk_tokens // spec.block_size)
    start = time.perf_counter()
    for off in range(0, nblocks, step):
        await sender.send_blocks(desc, src[off : off + step], off)
    await sender.finish(desc, first_token=0)
    seconds = time.perf_counter() - start
    ok = True
    if check:
        ok = await call("digest", desc.block_ids) == digest(BlockBytes(kv), src)
        _progress(f"{path} {_label(tokens)}: receiver's blocks {'match' if ok else 'DIFFER FROM'} the sender's")
    await call("free", tid)
    return seconds, ok


async def _raw_once(ep, call, kv, spec, nbytes) -> float:
    import numpy as np

    from kvtransfer.ucx import ucx_buffer

    data = ucx_buffer(BlockBytes(kv).run(1, nbytes // spec.block_bytes))
    ack = np.empty(1, dtype=np.uint8)
    await call("raw_expect", nbytes)
    start = time.perf_counter()
    await ep.send(data, tag=RAW_DATA_TAG)
    await ep.recv(ack, tag=RAW_ACK_TAG)
    seconds = time.perf_counter() - start
    await call("raw_done")
    return seconds


async def _raw_connect(port: int, host: str = "127.0.0.1"):
    from kvtransfer.ucx import import_ucxx
    from kvtransfer.ucx_progress import ensure_progress

    ucxx = import_ucxx()
    ensure_progress(ucxx)  # the same UCX settings and progress as pdserve's path
    return await ucxx.create_endpoint(host, port)


def _ask(conn, msg):
    conn.send(msg)
    if not conn.poll(300):
        raise TimeoutError(f"benchmark receiver did not answer {msg[0]!r}")
    kind, value = conn.recv()
    if kind == "error":
        raise RuntimeError(f"benchmark receiver failed: {value}")
    return value


# -- reporting -----------------------------------------------------------------


def _ucx_available() -> tuple[bool, str | None]:
    from kvtransfer.ucx import UcxUnavailable, import_ucxx

    try:
        import_ucxx()
        return True, None
    except UcxUnavailable as e:
        return False, str(e)


def _label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def _progress(line: str) -> None:
    print(f"[bench kvtransfer] {line}", file=sys.stderr, flush=True)


def _summary(spec, sizes, blocks_for, chunk_tokens, repeats, samples, verified, ucx_why, device) -> dict:
    out_sizes = {}
    for n in sizes:
        entry = {"tokens": n, "bytes": blocks_for[n] * spec.block_bytes}
        for path, vals in samples[n].items():
            entry[f"{path}_gbps"] = round(statistics.median(vals), 3)
            entry[f"{path}_samples_gbps"] = [round(v, 3) for v in vals]
        out_sizes[_label(n)] = entry

    def ratio(a: str, b: str) -> float | None:
        e = out_sizes.get("8k", {})
        return round(e[f"{a}_gbps"] / e[f"{b}_gbps"], 3) if f"{a}_gbps" in e and f"{b}_gbps" in e else None

    return {
        "model_layout": "SmolLM2-135M",
        "device": device,
        "block_bytes": spec.block_bytes,
        "chunk_tokens": chunk_tokens,
        "repeats": repeats,
        "statistic": "median GB/s (1e9 bytes/s)",
        "ucx_put_share": TransferConfig().ucx_put_share,
        "sizes": out_sizes,
        "ucx_vs_raw_8k": ratio("ucx", "raw"),
        "ucx_vs_tcp_8k": ratio("ucx", "tcp"),
        "goal": {"ucx_vs_raw_8k": 0.6, "ucx_vs_tcp_8k": 2.0},
        "verified": verified,
        "ucx_unavailable": ucx_why,
    }


def print_table(result: dict) -> None:
    paths = [p for p in ("ucx", "tcp", "raw") if any(f"{p}_gbps" in e for e in result["sizes"].values())]
    print(
        f"KV transfer, {result['model_layout']} layout ({result['block_bytes']:,} B/block) on {result['device']}, "
        f"chunks of {result['chunk_tokens']} tokens, {result['statistic']} of {result['repeats']}"
    )
    print(f"{'prompt':>7} {'MB':>8} " + " ".join(f"{p + ' GB/s':>9}" for p in paths))
    for label, e in result["sizes"].items():
        cells = " ".join(f"{e.get(p + '_gbps', float('nan')):9.2f}" for p in paths)
        print(f"{label:>7} {e['bytes'] / 1e6:8.1f} {cells}")
    for key, goal in result["goal"].items():
        value = result[key]
        verdict = "n/a" if value is None else ("meets goal" if value >= goal else "BELOW goal")
        print(f"{key} = {value if value is not None else 'n/a'}  (goal >= {goal}: {verdict})")
    if "loadavg_1m" in result:
        print(f"1-minute load average {result['loadavg_1m'][0]} before, {result['loadavg_1m'][1]} after")
    if not result["verified"]:
        print("DATA MISMATCH: the receiver's blocks differ from the sender's")


if __name__ == "__main__":
    sys.exit(main())
