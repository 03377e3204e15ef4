"""The prefill side: write finished KV blocks into a receiver's reserved blocks.

Engine usage (prefill worker), one descriptor per request::

    sender = Sender(engine.kv_cache, namespace)
    desc = TransferDescriptor.from_bytes(request.kv_target)
    await sender.connect(desc.address)          # optional warm-up; compat check
    for chunk in prefill_chunks[:-1]:           # as each chunk's KV is written
        await sender.send_blocks(desc, chunk.block_ids, dst_offset=chunk.first_block_index)
    last = prefill_chunks[-1]                   # the last chunk and the finish: one message
    await sender.finish(desc, first_token, blocks=last.block_ids, dst_offset=last.first_block_index)
    # finish returns once the receiver has it all
    # on any error: await sender.abort(desc, reason)

Ownership: the sender never holds the source blocks beyond a call. When
``send_blocks`` returns *or raises* (cancellation included), no transport
reads them any more, so the engine may free or reuse them right after. On
CUDA, ``send_blocks`` synchronises the current stream first, so the KV the
forward pass just wrote is what goes out.

Connections are made on first use per receiver address (``hello`` /
``welcome`` with the compatibility check) and shared by all transfers to that
receiver. A receiver that refuses us gets an ``abort`` for the transfer that
prompted the connection, so both sides fail with the same clear error.

Sharing holds because one transfer's cancellation is its own: over TCP, a send
cancelled part-way abandons just its message and the connection stays in step
(``tcp.py``); a timeout, or any error that closed the connection, fails every
transfer on it (the link is dropped and the next transfer connects again).
UCX still closes its connection on a cancelled send.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvtransfer.block_runs import coalesce
from kvtransfer.checksum import run_sums
from kvtransfer.config import TransferConfig
from kvtransfer.descriptor import PeerInfo, TransferDescriptor
from kvtransfer.endpoint import Endpoint
from kvtransfer.errors import TransferError
from kvtransfer.faults import TransferFaults
from kvtransfer.protocol import ABORT, BLOCKS, DONE, FAILED, FINISH, HELLO, REFUSED, WELCOME
from kvtransfer.stats import TransferStats
from kvtransfer.transport import Connection, Transport

log = logging.getLogger(__name__)
_REMEMBER = 4096  # per-transfer bookkeeping kept for transfers never finished nor aborted


@dataclass(eq=False)
class _Link:
    """One connection to one receiver, shared by every transfer to it."""

    address: str
    conn: Connection
    remote: PeerInfo
    acks: dict[str, asyncio.Future] = field(default_factory=dict)  # finish awaiting done/failed
    failed: collections.OrderedDict = field(default_factory=collections.OrderedDict)  # tid -> error
    dead: TransferError | None = None
    reader: asyncio.Task | None = None


@dataclass
class _Progress:
    started: float
    nbytes: int = 0
    counted_failure: bool = False


class Sender(Endpoint):
    def __init__(
        self,
        kv_cache: torch.Tensor,
        namespace: str,
        config: TransferConfig | None = None,
        *,
        transport: Transport | None = None,
        stats: TransferStats | None = None,
    ):
        super().__init__(kv_cache, namespace, config, transport, stats)
        self.faults = TransferFaults.from_env()  # off unless PDSERVE_KV_FAULTS is set (tests, bench chaos)
        self._links: dict[str, _Link] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._progress: collections.OrderedDict[str, _Progress] = collections.OrderedDict()

    async def connect(self, address: str) -> None:
        """Connect and run the compatibility check now rather than on the first chunk."""
        await self._link(address, None)

    async def send_blocks(self, desc: TransferDescriptor, src_block_ids: Sequence[int], dst_offset: int = 0) -> None:
        """Write our blocks ``src_block_ids`` into ``desc.block_ids[dst_offset:][:len(src_block_ids)]``."""
        src = self._check_blocks(desc, src_block_ids, dst_offset)
        progress = self._track(desc.transfer_id)
        link = await self._usable_link(desc)
        await self._send_blocks(link, desc, src, dst_offset, None)
        progress.nbytes += len(src) * self._blocks.block_bytes

    def _check_blocks(self, desc: TransferDescriptor, src_block_ids: Sequence[int], dst_offset: int) -> list[int]:
        src = [int(b) for b in src_block_ids]
        if not src or dst_offset < 0 or dst_offset + len(src) > desc.num_blocks:
            raise ValueError(f"{len(src)} blocks at offset {dst_offset} do not fit the {desc.num_blocks} "
                             f"reserved for {desc.transfer_id}")
        self._blocks.check_ids(src, "source")
        return src

    async def _send_blocks(self, link: _Link, desc: TransferDescriptor, src: list[int], dst_offset: int,
                           finish: dict | None) -> None:
        tid = desc.transfer_id
        runs = coalesce(src, desc.block_ids[dst_offset : dst_offset + len(src)])
        payload = [self._blocks.run(r.src, r.count) for r in runs]
        if self._blocks.device.type == "cuda":
            torch.cuda.current_stream(self._blocks.device).synchronize()
        header = {"type": BLOCKS, "transfer_id": tid, "runs": [[r.dst, r.count] for r in runs]}
        if self.config.checksum:
            header["sums"] = run_sums(payload)
        if finish is not None:
            header["finish"] = finish
        await self._timed(link, link.conn.send(header, payload), f"sending blocks of {tid}", tid)

    async def finish(self, desc: TransferDescriptor, first_token: int, meta: dict | None = None,
                     blocks: Sequence[int] = (), dst_offset: int = 0) -> None:
        """Close the transfer; returns once the receiver confirmed every block arrived.

        ``blocks`` (with ``dst_offset``, as for ``send_blocks``): the last blocks, sent in the
        same message as the finish, which saves the receiver a message on the way to the first
        token. As with ``send_blocks``, no transport reads them once this returns or raises.
        """
        tid = desc.transfer_id
        src = self._check_blocks(desc, blocks, dst_offset) if len(blocks) else []
        progress = self._track(tid)
        link = await self._usable_link(desc)
        ack = asyncio.get_running_loop().create_future()
        link.acks[tid] = ack
        try:
            await self.faults.before_finish(tid)
            end = {"first_token": int(first_token), "meta": meta or {}}
            if src:
                await self._send_blocks(link, desc, src, dst_offset, end)
                progress.nbytes += len(src) * self._blocks.block_bytes
            else:
                await self._timed(link, link.conn.send({"type": FINISH, "transfer_id": tid, **end}),
                                  f"finishing {tid}", tid)
            await self._timed(link, asyncio.shield(ack), f"waiting for {tid} to be confirmed", tid)
        finally:
            link.acks.pop(tid, None)
        self._progress.pop(tid, None)
        link.failed.pop(tid, None)
        self.stats.record_success(progress.nbytes, time.monotonic() - progress.started)

    async def abort(self, desc: TransferDescriptor, reason: str) -> None:
        """Tell the receiver to drop the transfer (best effort: never raises)."""
        tid = desc.transfer_id
        progress = self._progress.pop(tid, None)
        if progress is None or not progress.counted_failure:
            self.stats.record_failure()
        link = self._links.get(desc.address)
        if link is None or link.dead is not None:
            return  # the receiver is gone or was never reached: its own timeout releases
        link.failed.pop(tid, None)
        with contextlib.suppress(TransferError, asyncio.TimeoutError):
            msg = {"type": ABORT, "transfer_id": tid, "reason": reason}
            await asyncio.wait_for(link.conn.send(msg), self.config.op_timeout_s)

    async def close(self) -> None:
        for link in list(self._links.values()):
            self._kill(link, TransferError(f"sender closed its connection to {link.address}"))

    # -- connections -----------------------------------------------------------

    async def _usable_link(self, desc: TransferDescriptor) -> _Link:
        tid = desc.transfer_id
        try:
            link = await self._link(desc.address, tid)
            if desc.peer != link.remote:
                raise TransferError(
                    f"descriptor of {tid} describes another KV layout than its receiver "
                    f"{desc.address} now has (stale descriptor?)"
                )
            if tid in link.failed:
                raise TransferError(f"receiver failed transfer {tid}: {link.failed[tid]}")
        except TransferError:
            self._count_failure(tid, timeout=False)
            raise
        return link

    async def _link(self, address: str, tid: str | None) -> _Link:
        link = self._links.get(address)
        if link is not None and link.dead is None:
            return link
        lock = self._connecting.setdefault(address, asyncio.Lock())
        async with lock:
            link = self._links.get(address)
            if link is not None and link.dead is None:
                return link
            conn = await self.transport.connect(address, self.config.connect_timeout_s)
            try:
                await conn.send({"type": HELLO, "peer": self.peer.to_dict()})
                reply = await asyncio.wait_for(conn.recv(), self.config.connect_timeout_s)
                if reply.get("type") == REFUSED:
                    self.stats.refused_peers += 1
                    error = TransferError(f"receiver {address} refused us: {reply.get('error')}")
                    if tid is not None:
                        await conn.send({"type": ABORT, "transfer_id": tid, "reason": str(error)})
                    raise error
                if reply.get("type") != WELCOME:
                    raise TransferError(f"unexpected reply {reply.get('type')!r} to hello from {address}")
                remote = PeerInfo.from_dict(reply.get("peer", {}))
                self.peer.check_compatible(remote, peer=address)
            except TimeoutError:
                conn.close()
                raise TransferError(
                    f"no answer to hello from {address} within {self.config.connect_timeout_s:g}s"
                ) from None
            except BaseException:
                conn.close()
                raise
            link = _Link(address, conn, remote)
            link.reader = asyncio.get_running_loop().create_task(self._read(link))
            self._links[address] = link
            return link

    async def _read(self, link: _Link) -> None:
        """Receiver -> sender messages: ``done`` and ``failed``."""
        try:
            while True:
                msg = await link.conn.recv()
                tid = str(msg.get("transfer_id"))
                ack = link.acks.get(tid)
                if msg.get("type") == DONE and ack is not None and not ack.done():
                    ack.set_result(None)
                elif msg.get("type") == FAILED:
                    link.failed[tid] = str(msg.get("error"))
                    while len(link.failed) > _REMEMBER:
                        link.failed.popitem(last=False)
                    if ack is not None and not ack.done():
                        ack.set_exception(TransferError(f"receiver failed transfer {tid}: {msg.get('error')}"))
        except TransferError as e:
            self._kill(link, TransferError(f"connection to receiver {link.address} lost: {e}"))
        except Exception as e:
            log.exception("KV sender connection to %s failed", link.address)
            self._kill(link, TransferError(f"connection to receiver {link.address} failed: {e}"))

    def _kill(self, link: _Link, error: TransferError) -> None:
        if link.dead is None:
            link.dead = error
        link.conn.close()
        if self._links.get(link.address) is link:
            del self._links[link.address]
        for ack in link.acks.values():
            if not ack.done():
                ack.set_exception(error)
        if link.reader is not None and link.reader is not asyncio.current_task():
            link.reader.cancel()

    async def _timed(self, link: _Link, aw, what: str, tid: str):
        try:
            return await asyncio.wait_for(aw, self.config.op_timeout_s)
        except TimeoutError:
            # The message may be half sent: the connection cannot be used any more.
            error = TransferError(f"{what} to {link.address} timed out after {self.config.op_timeout_s:g}s")
            self._kill(link, error)
            self._count_failure(tid, timeout=True)
            raise error from None
        except TransferError as e:
            if link.conn.closed:
                self._kill(link, e)
            self._count_failure(tid, timeout=False)
            raise

    def _track(self, tid: str) -> _Progress:
        progress = self._progress.get(tid)
        if progress is None:
            progress = self._progress[tid] = _Progress(time.monotonic())
            while len(self._progress) > _REMEMBER:
                self._progress.popitem(last=False)
        return progress

    def _count_failure(self, tid: str, *, timeout: bool) -> None:
        progress = self._track(tid)
        if not progress.counted_failure:
            progress.counted_failure = True
            self.stats.record_failure(timeout=timeout)
