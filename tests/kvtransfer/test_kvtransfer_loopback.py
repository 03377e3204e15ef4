"""The block protocol in one process over the loopback transport: paths a real
sender never takes (malformed chunks, early finish) and the receiver's own
cancel and shutdown, each ending with the leak check."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvtransfer import Receiver, Sender, TransferConfig, TransferError
from kvtransfer.protocol import BLOCKS, FINISH, HELLO
from services.engine.kv_cache import KVCacheSpec, allocate_kv_cache
from services.errors import CapacityError

pytestmark = pytest.mark.timeout(30)
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
N = 16


class Pool:
    def __init__(self):
        self.free = list(range(1, N))
        self.released: list[str] = []

    def reserve(self, tid, n):
        if n > len(self.free):
            raise CapacityError(f"{n} blocks wanted, {len(self.free)} free")
        ids, self.free = self.free[-n:], self.free[:-n]
        return ids

    def release(self, tid, ids):
        self.released.append(tid)
        self.free.extend(ids)


async def _pair(**config):
    cfg = TransferConfig(transport="loopback", op_timeout_s=5, **config)
    src = allocate_kv_cache(SPEC, N)
    src.copy_(torch.randn(src.shape))
    dst, pool = allocate_kv_cache(SPEC, N), Pool()
    rx = Receiver(dst, "m", pool, cfg)
    await rx.start()
    tx = Sender(src, "m", cfg, transport=rx.transport)
    return src, dst, pool, rx, tx


def test_chunks_land_in_the_reserved_blocks_in_prompt_order():
    async def go():
        src, dst, pool, rx, tx = await _pair()
        pending = rx.reserve("r", 5, timeout_s=5)
        order = [9, 2, 3, 4, 11]
        await tx.send_blocks(pending.descriptor, order[3:], dst_offset=3)  # chunks may come in any order
        await tx.send_blocks(pending.descriptor, order[:3], dst_offset=0)
        await tx.finish(pending.descriptor, first_token=17, meta={"prompt_tokens": 20})
        done = await pending
        assert (done.first_token, done.meta, done.nbytes) == (17, {"prompt_tokens": 20}, 5 * SPEC.block_bytes)
        assert torch.equal(dst[list(done.block_ids)], src[order])
        assert rx.stats.completed == tx.stats.completed == 1 and pool.released == []

    asyncio.run(go())


def test_last_chunk_carries_the_finish():
    async def go():
        src, dst, pool, rx, tx = await _pair()
        pending = rx.reserve("r", 5, timeout_s=5)
        order = [9, 2, 3, 4, 11]
        await tx.send_blocks(pending.descriptor, order[:3], dst_offset=0)
        await tx.finish(pending.descriptor, first_token=17, blocks=order[3:], dst_offset=3)  # one message
        done = await pending
        assert (done.first_token, done.nbytes) == (17, 5 * SPEC.block_bytes)
        assert torch.equal(dst[list(done.block_ids)], src[order])
        assert rx.stats.completed == tx.stats.completed == 1 and pool.released == []
        # a last chunk that leaves a block unsent fails the transfer like a bare finish
        short = rx.reserve("s", 3, timeout_s=5)
        with pytest.raises(TransferError, match="1 of 3 blocks never sent"):
            await tx.finish(short.descriptor, first_token=1, blocks=[5, 6], dst_offset=0)
        with pytest.raises(TransferError, match="1 of 3 blocks never sent"):
            await short
        assert pool.released == ["s"] and len(pool.free) == N - 1 - 5

    asyncio.run(go())


def test_finish_before_every_block_arrived_fails_and_releases():
    async def go():
        _, _, pool, rx, tx = await _pair()
        pending = rx.reserve("r", 4, timeout_s=5)
        await tx.send_blocks(pending.descriptor, [1, 2], dst_offset=0)
        with pytest.raises(TransferError, match="finished with 2 of 4 blocks never sent"):
            await tx.finish(pending.descriptor, first_token=1)
        with pytest.raises(TransferError, match="2 of 4 blocks never sent"):
            await pending
        assert pool.released == ["r"] and len(pool.free) == N - 1

    asyncio.run(go())


def test_chunk_outside_the_reservation_is_rejected():
    async def go():
        _, dst, pool, rx, _ = await _pair()
        pending = rx.reserve("r", 2, timeout_s=5)
        conn = await rx.transport.connect(rx.address, 1)
        await conn.send({"type": HELLO, "peer": rx.peer.to_dict()})
        await conn.recv()  # welcome
        foreign = next(b for b in range(1, N) if b not in pending.descriptor.block_ids)
        payload = [torch.zeros(SPEC.block_bytes, dtype=torch.uint8)]
        await conn.send({"type": BLOCKS, "transfer_id": "r", "runs": [[foreign, 1]]}, payload)
        reply = await conn.recv()
        assert reply["type"] == "failed" and "outside its reservation" in reply["error"]
        with pytest.raises(TransferError, match="outside its reservation"):
            await pending
        assert not dst[foreign].any()  # nothing was written outside the reservation
        await conn.send({"type": FINISH, "transfer_id": "r", "first_token": 0})
        assert "already failed" in (await conn.recv())["error"]
        assert len(pool.free) == N - 1
        conn.close()

    asyncio.run(go())


def test_cancel_and_close_release_every_pending_transfer():
    async def go():
        _, _, pool, rx, tx = await _pair()
        a = rx.reserve("a", 3, timeout_s=5)
        b = rx.reserve("b", 3, timeout_s=5)
        await tx.send_blocks(a.descriptor, [1, 2, 3])
        rx.cancel("a", "cancelled: client went away")
        with pytest.raises(TransferError, match="client went away"):
            await a
        with pytest.raises(TransferError, match="client went away"):
            await tx.finish(a.descriptor, first_token=1)  # the sender learns why
        await rx.close()
        with pytest.raises(TransferError, match="receiver shutting down"):
            await b
        assert sorted(pool.released) == ["a", "b"] and len(pool.free) == N - 1 and rx.open_transfers == 0

    asyncio.run(go())


def test_sender_abort_releases_at_once():
    async def go():
        _, _, pool, rx, tx = await _pair()
        pending = rx.reserve("r", 2, timeout_s=30)
        await tx.send_blocks(pending.descriptor, [5])
        await tx.abort(pending.descriptor, "prefill failed: out of memory")
        with pytest.raises(TransferError, match="aborted by the sender: prefill failed"):
            await pending
        assert pool.released == ["r"] and tx.stats.failed == 1

    asyncio.run(go())


def test_reservation_errors():
    async def go():
        _, _, pool, rx, _ = await _pair()
        with pytest.raises(CapacityError):
            rx.reserve("huge", N, timeout_s=1)
        rx.reserve("r", 1, timeout_s=1)
        with pytest.raises(ValueError, match="already pending"):
            rx.reserve("r", 1, timeout_s=1)
        await rx.close()
        assert len(pool.free) == N - 1

    asyncio.run(go())
