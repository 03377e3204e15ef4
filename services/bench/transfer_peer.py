"""The receiving process of ``pdserve bench kvtransfer``: the decode side.

Runs a UCX and a TCP ``Receiver`` over one KV cache and one block pool, plus a
raw ucxx listener that receives one contiguous buffer into the same cache,
and answers the benchmark's commands over a pipe.
"""

from __future__ import annotations

import asyncio
import hashlib

from kvtransfer.block_runs import BlockBytes, coalesce
from kvtransfer.config import TransferConfig
from kvtransfer.receiver import Receiver
from services.engine.kv_cache import allocate_kv_cache
from services.errors import CapacityError

NAMESPACE = "bench/SmolLM2-135M"
RAW_DATA_TAG, RAW_ACK_TAG = 2, 3


def digest(blocks: BlockBytes, ids) -> str:
    h = hashlib.blake2b(digest_size=16)
    for r in coalesce(ids, ids):
        h.update(memoryview(blocks.run(r.src, r.count).cpu().numpy()))
    return h.hexdigest()


class _FreeList:
    """Block owner of the benchmark: lowest ids first, like a fresh engine's pool."""

    def __init__(self, num_blocks: int):
        self.free = list(range(1, num_blocks))
        self.held: dict[str, list[int]] = {}

    def reserve(self, tid: str, n: int) -> list[int]:
        if n > len(self.free):
            raise CapacityError(f"{n} blocks wanted, {len(self.free)} free")
        self.held[tid], self.free = self.free[:n], self.free[n:]
        return self.held[tid]

    def release(self, tid: str, ids) -> None:
        self.held.pop(tid, None)
        self.free = sorted(self.free + list(ids))


def receiver_process(conn, spec, num_blocks, transports, raw, device, host="127.0.0.1", advertise="") -> None:
    asyncio.run(_receiver_main(conn, spec, num_blocks, transports, raw, device, host, advertise))


async def _receiver_main(conn, spec, num_blocks, transports, raw, device, host, advertise) -> None:
    kv = allocate_kv_cache(spec, num_blocks, device)
    blocks = BlockBytes(kv)
    pool = _FreeList(num_blocks)
    receivers = {t: Receiver(kv, NAMESPACE, pool, TransferConfig(transport=t, host=host, advertise_host=advertise))
                 for t in transports}
    addresses = {t: await r.start() for t, r in receivers.items()}
    raw_eps: list = []  # the raw benchmark's endpoint, once the sender connected
    listener = _raw_listen(raw_eps) if raw else None
    addresses["raw"] = listener.port if listener else None
    raw_task = None
    pending = {}
    loop = asyncio.get_running_loop()
    while True:
        msg = await loop.run_in_executor(None, conn.recv)
        try:
            if msg[0] == "addresses":
                reply = addresses
            elif msg[0] == "reserve":
                _, path, tid, n = msg
                pending[tid] = (receivers[path].reserve(tid, n, timeout_s=120), path)
                reply = pending[tid][0].descriptor.to_bytes()
            elif msg[0] == "raw_expect":
                # Posted only now, so no UCX request is pending (and polled) while
                # the other paths are measured.
                for _ in range(500):  # the listener hands the endpoint over just after connect
                    if raw_eps:
                        break
                    await asyncio.sleep(0.01)
                raw_task = loop.create_task(_raw_receive(raw_eps[0], blocks, msg[1]))
                reply = True
            elif msg[0] == "raw_done":
                await raw_task
                reply = True
            elif msg[0] == "digest":
                reply = digest(blocks, list(msg[1]))
            elif msg[0] == "free":
                p, _ = pending.pop(msg[1])
                done = await p  # the sender's finish returned, so this is resolved
                pool.release(msg[1], done.block_ids)  # the "sequence" ends at once
                reply = True
            elif msg[0] == "stop":
                for r in receivers.values():
                    await r.close()
                for ep in raw_eps:
                    ep.abort()
                conn.send(("ok", True))
                return
            else:
                raise ValueError(f"unknown command {msg[0]!r}")
            conn.send(("ok", reply))
        except Exception as e:  # noqa: BLE001 - reported to the benchmark driver
            conn.send(("error", f"{type(e).__name__}: {e}"))


def _raw_listen(raw_eps: list):
    from kvtransfer.ucx import import_ucxx
    from kvtransfer.ucx_progress import ensure_progress

    async def handler(ep) -> None:
        raw_eps.append(ep)

    ucxx = import_ucxx()
    ensure_progress(ucxx)
    return ucxx.create_listener(handler)


async def _raw_receive(ep, blocks: BlockBytes, nbytes: int) -> None:
    import numpy as np

    from kvtransfer.ucx import ucx_buffer

    await ep.recv(ucx_buffer(blocks.run(1, nbytes // blocks.block_bytes)), tag=RAW_DATA_TAG)
    await ep.send(np.ones(1, dtype=np.uint8), tag=RAW_ACK_TAG)
