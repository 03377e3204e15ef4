"""The decode side: reserve blocks, let senders fill them, learn how it ended.

The ownership contract (who frees the reserved blocks, and when) is in
``ownership.py``. ``owner.release`` is called only after no write can reach
the blocks any more: a transfer that fails while one of its chunks is being
received waits for that chunk to end, and cuts the sender's connection if it
takes longer than ``TransferConfig.drain_grace_s``. So a released block can be
reused at once. Every path ends: completion, sender abort, sender death,
timeout, ``cancel`` and ``close`` all resolve the pending transfer.

Engine usage (decode worker)::

    receiver = Receiver(engine.kv_cache, namespace, owner=block_pool_adapter)
    await receiver.start()
    pending = receiver.reserve(request_id, num_blocks, timeout_s=30)   # CapacityError if full
    ...hand pending.descriptor.to_bytes() to the prefill side...
    done = await pending        # Completion(first_token, meta, block_ids, ...) or TransferError
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass, field

import torch

from kvtransfer.checksum import run_sums
from kvtransfer.config import TransferConfig
from kvtransfer.descriptor import PeerInfo, TransferDescriptor
from kvtransfer.endpoint import Endpoint
from kvtransfer.errors import SendAbandoned, TransferError
from kvtransfer.faults import TransferFaults
from kvtransfer.ownership import BlockOwner, Completion, PendingTransfer
from kvtransfer.protocol import ABORT, BLOCKS, DONE, FAILED, FINISH, HELLO, REFUSED, WELCOME, payload_sizes
from kvtransfer.stats import TransferStats
from kvtransfer.transport import Connection, Listener, Transport, split_address

log = logging.getLogger(__name__)
_OPEN, _FAILING, _ENDED = "open", "failing", "ended"
_REMEMBER_FAILED = 4096  # failure reasons kept for late chunks' error messages


@dataclass(eq=False)
class _Transfer:
    descriptor: TransferDescriptor
    future: asyncio.Future
    started: float
    position: dict[int, int]  # block id -> index in the prompt
    written: bytearray  # 1 per block received at least once
    state: str = _OPEN
    conn: Connection | None = None  # the sender it is bound to, from its first chunk
    inflight: int = 0  # chunks being written into the blocks right now
    nbytes: int = 0
    error: TransferError | None = None
    timers: list = field(default_factory=list)


class Receiver(Endpoint):
    def __init__(
        self,
        kv_cache: torch.Tensor,
        namespace: str,
        owner: BlockOwner,
        config: TransferConfig | None = None,
        *,
        transport: Transport | None = None,
        stats: TransferStats | None = None,
    ):
        super().__init__(kv_cache, namespace, config, transport, stats)
        self._owner = owner
        self._transfers: dict[str, _Transfer] = {}
        self._failed: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._conns: set[Connection] = set()
        self._listener: Listener | None = None
        self._advertised = ""
        self.faults = TransferFaults.from_env()  # off unless PDSERVE_KV_FAULTS is set (tests, bench chaos)

    @property
    def address(self) -> str:
        if self._listener is None:
            raise RuntimeError("Receiver.start() has not been awaited")
        return self._advertised

    @property
    def open_transfers(self) -> int:
        return len(self._transfers)

    async def start(self) -> str:
        self._listener = await self.transport.listen(self.config.host, self.config.port, self._serve)
        self._advertised = self._listener.address
        # Listening on a wildcard (a container): descriptors must name an address peers reach.
        if self.config.advertise_host and self.config.transport != "loopback":
            scheme = self._advertised.split("://", 1)[0]
            _, port = split_address(self._advertised, scheme)
            host = self.config.advertise_host
            self._advertised = f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"
        return self._advertised

    def reserve(self, transfer_id: str, num_blocks: int, timeout_s: float) -> PendingTransfer:
        """Reserve blocks through the owner and wait up to ``timeout_s`` for a sender to fill them."""
        if transfer_id in self._transfers:
            raise ValueError(f"transfer {transfer_id!r} is already pending")
        if num_blocks < 1 or timeout_s <= 0:
            raise ValueError("a transfer needs at least one block and a positive timeout")
        block_ids = tuple(self._owner.reserve(transfer_id, num_blocks))  # CapacityError propagates
        try:
            if len(block_ids) != num_blocks:
                raise ValueError(f"owner reserved {len(block_ids)} blocks, {num_blocks} were asked for")
            self._blocks.check_ids(block_ids, "reserved")
            desc = TransferDescriptor(self.address, transfer_id, block_ids, self.peer)
        except BaseException:
            self._owner.release(transfer_id, block_ids)
            raise
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if nobody awaits
        t = _Transfer(desc, future, time.monotonic(), {b: i for i, b in enumerate(block_ids)}, bytearray(num_blocks))
        t.timers.append(loop.call_later(timeout_s, self._timed_out, t, timeout_s))
        self._transfers[transfer_id] = t
        self._failed.pop(transfer_id, None)
        return PendingTransfer(desc, future)

    def cancel(self, transfer_id: str, reason: str = "cancelled by the decode side") -> bool:
        """Fail the transfer if it is pending; True if it was (open, or failing while a chunk lands):
        then the receiver releases its blocks, once no write can reach them, and the caller must not."""
        t = self._transfers.get(transfer_id)
        if t is not None:
            self._fail(t, TransferError(f"transfer {transfer_id} {reason}"))
        return t is not None

    async def close(self) -> None:
        """Fail every pending transfer (releasing its blocks) and stop listening."""
        for t in list(self._transfers.values()):
            self._fail(t, TransferError(f"transfer {t.descriptor.transfer_id}: receiver shutting down"))
        if self._listener is not None:
            await self._listener.close()
        for conn in list(self._conns):
            conn.close()
        deadline = time.monotonic() + self.config.drain_grace_s + 1.0
        while self._transfers and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    # -- one connection --------------------------------------------------------

    async def _serve(self, conn: Connection) -> None:
        self._conns.add(conn)
        reason = "connection closed"
        try:
            hello = await asyncio.wait_for(conn.recv(), self.config.connect_timeout_s)
            if hello.get("type") != HELLO:
                raise TransferError(f"expected hello from {conn.peer}, got {hello.get('type')!r}")
            diffs = self.peer.mismatches(PeerInfo.from_dict(hello.get("peer", {})))
            if diffs:
                await self._refuse(conn, f"incompatible KV peer {conn.peer}: " + "; ".join(diffs))
                return
            await conn.send({"type": WELCOME, "peer": self.peer.to_dict()})
            while True:
                msg = await conn.recv()
                kind = msg.get("type")
                if kind == BLOCKS:
                    await self._on_blocks(conn, msg)
                elif kind == FINISH:
                    await self._on_finish(conn, msg)
                elif kind == ABORT:
                    self._on_abort(msg, f"aborted by the sender: {msg.get('reason', '')}")
                else:
                    raise TransferError(f"unexpected {kind!r} message from {conn.peer}")
        except TransferError as e:
            reason = str(e)
        except TimeoutError:
            reason = f"no hello from {conn.peer} within {self.config.connect_timeout_s:g}s"
        except Exception as e:
            log.exception("KV receiver connection %s failed", conn.peer)
            reason = f"{type(e).__name__}: {e}"
        finally:
            if reason != "connection closed":
                log.warning("KV receiver: closing the connection from %s: %s", conn.peer, reason)
            conn.close()
            self._conns.discard(conn)
            for t in list(self._transfers.values()):
                if t.conn is conn:
                    self._fail(t, TransferError(f"sender {conn.peer} disconnected mid-transfer: {reason}"))

    async def _refuse(self, conn: Connection, reason: str) -> None:
        self.stats.refused_peers += 1
        log.warning("refusing KV sender: %s", reason)
        await conn.send({"type": REFUSED, "error": reason})
        # The sender aborts the transfer that made it connect, so that transfer
        # fails here with the compatibility error instead of timing out.
        while True:
            try:
                msg = await asyncio.wait_for(conn.recv(), self.config.connect_timeout_s)
            except (TimeoutError, TransferError):
                return
            if msg.get("type") != ABORT:
                return
            self._on_abort(msg, reason)

    async def _on_blocks(self, conn: Connection, msg: dict) -> None:
        tid = str(msg.get("transfer_id"))
        t = self._transfers.get(tid)
        try:
            if t is None or t.state != _OPEN:
                raise TransferError(self._why_not_open(tid, t))
            if t.conn is not None and t.conn is not conn:
                raise TransferError(f"transfer {tid} is already being sent by {t.conn.peer}")
            dests, positions = self._destinations(t, msg)
        except TransferError as e:
            if t is not None and t.state == _OPEN and t.conn in (None, conn):
                self._fail(t, e)  # malformed chunk: the transfer cannot be trusted any more
            with contextlib.suppress(SendAbandoned):  # rejected either way
                await conn.recv_payload(msg, [None] * len(payload_sizes(msg)))
            await conn.send({"type": FAILED, "transfer_id": tid, "error": str(e)})
            return
        t.conn = conn
        t.inflight += 1
        landed = False
        spoiled: TransferError | None = None  # abandoned or corrupted: the transfer fails
        try:
            try:
                await conn.recv_payload(msg, dests)
            except SendAbandoned as e:
                # The sender cancelled this chunk part-way (its request was aborted): this
                # transfer fails, the connection and the other transfers on it go on.
                spoiled = TransferError(f"chunk of {tid} was abandoned by the sender: {e}")
            else:
                self.faults.after_landing(tid, dests)
                spoiled = self._check_sums(tid, msg, dests)
            if spoiled is None:
                for p in positions:
                    t.written[p] = 1
                t.nbytes += sum(int(d.numel()) for d in dests)
                landed = True
        finally:
            t.inflight -= 1
            if t.state == _FAILING and t.inflight == 0:
                self._release(t)  # it failed while this chunk was landing; now nothing writes
        if spoiled is not None:
            log.warning("%s", spoiled)
            self._fail(t, spoiled)  # the sender hears it in a FAILED message (_fail notifies)
            return
        if landed and isinstance(msg.get("finish"), dict):  # the last chunk carries the finish
            await self._on_finish(conn, {**msg["finish"], "transfer_id": tid})

    @staticmethod
    def _check_sums(tid: str, msg: dict, dests: list[torch.Tensor]) -> TransferError | None:
        """A chunk whose runs came with checksums (kvtransfer/checksum.py) must match them."""
        sums = msg.get("sums")
        if sums is None:
            return None  # a sender with checksums off
        if not isinstance(sums, list) or len(sums) != len(dests):
            return TransferError(f"chunk of {tid} carries {len(sums) if isinstance(sums, list) else 'no'} "
                                 f"checksums for {len(dests)} runs")
        bad = [i for i, (want, got) in enumerate(zip(sums, run_sums(dests))) if want != got]
        if bad:
            return TransferError(f"chunk of {tid} arrived corrupted: the checksum of run {bad[0]} "
                                 f"(of {len(dests)}) does not match; its blocks are dropped")
        return None

    def _destinations(self, t: _Transfer, msg: dict) -> tuple[list[torch.Tensor], list[int]]:
        runs, sizes = msg.get("runs", []), payload_sizes(msg)
        if len(runs) != len(sizes):
            raise TransferError(f"chunk of {t.descriptor.transfer_id} lists {len(runs)} runs for {len(sizes)} buffers")
        dests, positions = [], []
        for (first, count), size in zip(runs, sizes):
            ids = range(int(first), int(first) + int(count))
            if count < 1 or any(b not in t.position for b in ids):
                raise TransferError(f"chunk of {t.descriptor.transfer_id} writes blocks outside its reservation")
            if size != count * self._blocks.block_bytes:
                raise TransferError(f"chunk of {t.descriptor.transfer_id}: {size} bytes for {count} blocks")
            dests.append(self._blocks.run(int(first), int(count)))
            positions.extend(t.position[b] for b in ids)
        return dests, positions

    async def _on_finish(self, conn: Connection, msg: dict) -> None:
        tid = str(msg.get("transfer_id"))
        t = self._transfers.get(tid)
        error = None
        if t is None or t.state != _OPEN:
            error = self._why_not_open(tid, t)
        elif t.conn is not None and t.conn is not conn:
            error = f"transfer {tid} is being sent by {t.conn.peer}"
        elif (missing := t.written.count(0)) > 0:
            error = f"transfer {tid} finished with {missing} of {len(t.written)} blocks never sent"
            self._fail(t, TransferError(error))
        if error is not None:
            await conn.send({"type": FAILED, "transfer_id": tid, "error": error})
            return
        t.state = _ENDED
        self._cancel_timers(t)
        del self._transfers[tid]
        seconds = time.monotonic() - t.started
        self.stats.record_success(t.nbytes, seconds)
        d = t.descriptor
        t.future.set_result(
            Completion(
                tid, d.block_ids, int(msg.get("first_token", -1)), dict(msg.get("meta") or {}), t.nbytes, seconds
            )
        )
        await conn.send({"type": DONE, "transfer_id": tid})

    def _on_abort(self, msg: dict, reason: str) -> None:
        t = self._transfers.get(str(msg.get("transfer_id")))
        if t is not None:
            self._fail(t, TransferError(f"transfer {t.descriptor.transfer_id} {reason}"))

    # -- failure paths ---------------------------------------------------------

    def _timed_out(self, t: _Transfer, timeout_s: float) -> None:
        done = t.written.count(1)
        err = TransferError(
            f"transfer {t.descriptor.transfer_id} timed out after {timeout_s:g}s "
            f"({done} of {len(t.written)} blocks received)"
        )
        self._fail(t, err, timeout=True)

    def _fail(self, t: _Transfer, error: TransferError, *, timeout: bool = False) -> None:
        if t.state != _OPEN:
            return
        t.state, t.error = _FAILING, error
        self._cancel_timers(t)
        self.stats.record_failure(timeout=timeout)
        tid = t.descriptor.transfer_id
        if t.conn is not None and not t.conn.closed:
            asyncio.get_running_loop().create_task(self._notify(t.conn, tid, str(error)))
        if t.inflight == 0:
            self._release(t)
        else:
            # A chunk is being written into the blocks: they may be released only
            # once it ends. A live sender finishes it quickly; a stuck one is cut off.
            conn = t.conn
            t.timers.append(asyncio.get_running_loop().call_later(self.config.drain_grace_s, conn.close))

    async def _notify(self, conn: Connection, tid: str, error: str) -> None:
        try:
            await conn.send({"type": FAILED, "transfer_id": tid, "error": error})
        except TransferError:
            pass  # the sender is gone; it learns from its own connection error

    def _release(self, t: _Transfer) -> None:
        t.state = _ENDED
        self._cancel_timers(t)
        tid = t.descriptor.transfer_id
        self._transfers.pop(tid, None)
        self._failed[tid] = str(t.error)
        while len(self._failed) > _REMEMBER_FAILED:
            self._failed.popitem(last=False)
        try:
            self._owner.release(tid, t.descriptor.block_ids)
        except Exception:
            log.exception("block owner failed to release the blocks of transfer %s", tid)
        if not t.future.done():
            t.future.set_exception(t.error)

    def _why_not_open(self, tid: str, t: _Transfer | None) -> str:
        if t is not None and t.error is not None:
            return str(t.error)
        if tid in self._failed:
            return f"transfer {tid} already failed: {self._failed[tid]}"
        return f"unknown transfer {tid}: not reserved at this receiver, or already finished"

    @staticmethod
    def _cancel_timers(t: _Transfer) -> None:
        for timer in t.timers:
            timer.cancel()
        t.timers.clear()
