"""A real pdserve process for the kvtransfer tests: a Sender or a Receiver, driven over a pipe.

The test process never imports ucxx: each peer is a child process (forked
from a forkserver that has torch loaded, never UCX) with its own KV cache (filled with seeded random bytes), its own event loop and, on the
receiver, a tiny block owner whose free count is the leak check. Commands run
concurrently in the child; every answer comes back within the caller's
timeout or the call fails, so no test can hang.

Transport ``ucx-put`` is ``ucx`` with ``ucx_put_min_bytes=1``: every payload,
however small, is split between the receiver's pull and the sender's put (by
default only messages of 4 MiB and more are), so the tests' small blocks take
the put path too.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import multiprocessing as mp
import time

import torch

from kvtransfer import Receiver, Sender, TransferConfig, TransferDescriptor
from kvtransfer.block_runs import BlockBytes
from services.engine.kv_cache import KVCacheSpec, allocate_kv_cache
from services.errors import CapacityError

# 32 KiB blocks: above UCX's 8 KiB rendezvous threshold, as real models' blocks are.
SPEC = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
NUM_BLOCKS = 64  # block 0 is the null block: 63 usable
NAMESPACE = "test/tiny-model"


class RemoteError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


# Children fork from a server process that imported torch once, instead of each
# spawning a fresh interpreter (seconds each on a busy 2-core machine). ucxx is
# not preloaded: UCX state must be created after the fork, in the child.
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "numpy", "services.engine.kv_cache", "kvtransfer.block_runs"])


class Peer:
    def __init__(
        self,
        role: str,
        transport: str,
        *,
        seed: int = 0,
        spec: KVCacheSpec = SPEC,
        namespace: str = NAMESPACE,
        device: str = "cpu",
        **config,
    ):
        ctx = _CTX
        self._conn, child = ctx.Pipe()
        self._ids = itertools.count()
        self._replies: dict[int, tuple] = {}
        self.process = ctx.Process(
            target=_child, args=(child, role, transport, seed, spec, namespace, device, config), daemon=True
        )
        self.process.start()

    def start(self, *cmd) -> int:
        i = next(self._ids)
        self._conn.send((i, cmd))
        return i

    def result(self, i: int, timeout: float = 20.0):
        while i not in self._replies:
            if not self._conn.poll(timeout):
                raise TimeoutError(f"peer gave no answer within {timeout}s")
            j, status, value = self._conn.recv()
            self._replies[j] = (status, value)
        status, value = self._replies.pop(i)
        if status == "error":
            raise RemoteError(*value)
        return value

    def call(self, *cmd, timeout: float = 20.0):
        return self.result(self.start(*cmd), timeout)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.call("close", timeout=10)
            except (TimeoutError, RemoteError, EOFError, OSError):
                pass
            self.process.join(5)
        if self.process.is_alive():
            self.kill()


def block_digests(kv: torch.Tensor, ids) -> list[str]:
    blocks = BlockBytes(kv)
    return [hashlib.blake2b(blocks.run(b, 1).cpu().numpy().tobytes(), digest_size=8).hexdigest() for b in ids]


class TinyPool:
    """The test's block owner: a free list that refuses when empty."""

    def __init__(self, num_blocks: int):
        self.free = list(range(1, num_blocks))
        self.held: dict[str, list[int]] = {}

    def reserve(self, tid: str, n: int) -> list[int]:
        if n > len(self.free):
            raise CapacityError(f"no room for {n} KV blocks ({len(self.free)} free)")
        # Take every other free block first so destinations are scattered, not one run.
        picked = (self.free[::2] + self.free[1::2])[:n]
        self.free = [b for b in self.free if b not in set(picked)]
        self.held[tid] = picked
        return picked

    def release(self, tid: str, ids) -> None:
        assert sorted(self.held.pop(tid)) == sorted(ids), "released blocks differ from reserved ones"
        self.free.extend(ids)


def _child(conn, role, transport, seed, spec, namespace, device, config) -> None:
    asyncio.run(_serve(conn, role, transport, seed, spec, namespace, device, config))


async def _serve(conn, role, transport, seed, spec, namespace, device, config) -> None:
    kv = allocate_kv_cache(spec, NUM_BLOCKS)
    kv.view(-1).view(torch.uint8).random_(generator=torch.Generator().manual_seed(seed))
    kv = kv.to(device)
    if transport == "ucx-put":
        transport, config = "ucx", {"ucx_put_min_bytes": 1, **config}
    cfg = TransferConfig(transport=transport, **config)
    pool = TinyPool(NUM_BLOCKS)
    outcomes: dict[str, asyncio.Future] = {}
    sending: dict[str, tuple[bytes, asyncio.Task]] = {}  # "start_sends": transfer id -> (descriptor, its send)
    if role == "receiver":
        kv.zero_()
        peer = Receiver(kv, namespace, pool, cfg)
        await peer.start()
    else:
        peer = Sender(kv, namespace, cfg)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    async def send_job(desc_bytes, chunks, first_token):
        desc = TransferDescriptor.from_bytes(desc_bytes)
        for src, offset in chunks:
            await peer.send_blocks(desc, src, offset)
        if first_token is not None:
            await peer.finish(desc, first_token, {"by": "test"})

    async def outcome(tid):
        c = await outcomes[tid]
        return {"first_token": c.first_token, "meta": c.meta, "block_ids": list(c.block_ids), "nbytes": c.nbytes}

    async def run(cmd):
        name, args = cmd[0], cmd[1:]
        if name == "address":
            return peer.address
        if name == "reserve":
            tid, n, timeout_s = args
            pending = peer.reserve(tid, n, timeout_s)
            outcomes[tid] = asyncio.ensure_future(_await(pending))
            return pending.descriptor.to_bytes()
        if name == "outcome":
            return await outcome(args[0])
        if name == "finish_sequence":  # a completed transfer's sequence ends: the engine frees its blocks
            pool.release(args[0], pool.held[args[0]])
            return True
        if name == "cancel":
            peer.cancel(args[0])
            return True
        if name == "free":
            return len(pool.free)
        if name == "digests":
            return block_digests(kv, args[0])
        if name == "send":
            await send_job(*args)
            return True
        if name == "send_many":
            results = await asyncio.gather(*(send_job(*job) for job in args[0]), return_exceptions=True)
            return [None if r is None else f"{type(r).__name__}: {r}" for r in results]
        if name == "start_sends":  # the sends go on in the background; see "cancel_send" and "await_sends"
            for job in args[0]:
                sending[TransferDescriptor.from_bytes(job[0]).transfer_id] = (job[0], loop.create_task(send_job(*job)))
            await asyncio.sleep(0)  # each has handed its first message to the transport
            return True
        if name == "cancel_send":  # as when a request is aborted mid-send: cancel, then abort() as handoff.py does
            desc, task = sending.pop(args[0])
            task.cancel()
            try:
                await task
                raised = "nothing"
            except asyncio.CancelledError:
                raised = "CancelledError"
            except Exception as e:  # noqa: BLE001 - reported to the test
                raised = f"{type(e).__name__}: {e}"
            await peer.abort(TransferDescriptor.from_bytes(desc), "request cancelled")
            return raised
        if name == "await_sends":
            results = await asyncio.gather(*(sending.pop(tid)[1] for tid in args[0]), return_exceptions=True)
            return [None if r is None else f"{type(r).__name__}: {r}" for r in results]
        if name == "connect":
            await peer.connect(args[0])
            return True
        if name == "idle_cpu":  # CPU seconds this process burns while sleeping for args[0] s
            before = time.process_time()
            await asyncio.sleep(args[0])
            return time.process_time() - before
        if name == "stats":
            return peer.stats.snapshot()
        if name == "traffic":  # UCX only: payload bytes sent, and how many of them by put
            traffic = peer.transport.traffic
            return {"sent_bytes": traffic.sent_bytes, "put_bytes": traffic.put_bytes}
        if name == "close":
            await peer.close()
            stop.set()
            return True
        raise ValueError(f"unknown command {name!r}")

    async def handle(i, cmd):
        try:
            reply = (i, "ok", await run(cmd))
        except Exception as e:  # noqa: BLE001 - every error goes back to the test
            reply = (i, "error", (type(e).__name__, str(e)))
        conn.send(reply)

    tasks = set()
    while not stop.is_set():
        ready = await loop.run_in_executor(None, conn.poll, 0.05)
        if ready:
            i, cmd = conn.recv()
            task = loop.create_task(handle(i, cmd))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks, return_exceptions=True)


async def _await(pending):
    return await pending
