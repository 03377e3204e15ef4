"""PDSERVE_KV_FAULTS (kvtransfer/faults.py): a transfer chosen to time out holds its finish back, the receiver's
reservation runs out first, its blocks go back, and the sender learns it failed; a chunk chosen to be corrupted
is caught by its checksum (kvtransfer/checksum.py), its transfer fails on both sides and its blocks go back;
other transfers are untouched. Off by default; a malformed setting is refused when the endpoint starts."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvtransfer.faults import TransferFaults
from kvtransfer.errors import TransferError
from tests.kvtransfer.test_kvtransfer_loopback import _pair

pytestmark = pytest.mark.timeout(30)


def test_the_chosen_transfer_times_out_on_the_receiver_and_the_others_pass(monkeypatch):
    monkeypatch.setenv("PDSERVE_KV_FAULTS", "timeout:2")
    monkeypatch.setenv("PDSERVE_KV_FAULT_STALL_S", "1.5")

    async def go():
        src, dst, pool, rx, tx = await _pair()
        outcomes = []
        for tid in ("a", "b", "c"):
            pending = rx.reserve(tid, 2, timeout_s=0.5)
            await tx.send_blocks(pending.descriptor, [3, 4])
            try:
                await tx.finish(pending.descriptor, first_token=1)
                await pending
                outcomes.append("ok")
            except TransferError:
                outcomes.append("failed")
                with pytest.raises(TransferError, match="timed out"):
                    await pending
        assert outcomes == ["ok", "failed", "ok"] and tx.faults.injected == 1
        assert rx.stats.timeouts == 1 and pool.released == ["b"]  # the timed-out reservation's blocks are back
        await rx.close()

    asyncio.run(go())


def test_off_by_default_and_a_bad_setting_is_refused():
    assert TransferFaults.from_env({}).timeouts == set()
    with pytest.raises(ValueError, match="PDSERVE_KV_FAULTS"):
        TransferFaults.from_env({"PDSERVE_KV_FAULTS": "explode:1"})
    with pytest.raises(ValueError, match="PDSERVE_KV_FAULT_STALL_S"):
        TransferFaults.from_env({"PDSERVE_KV_FAULTS": "timeout:1", "PDSERVE_KV_FAULT_STALL_S": "0"})


async def _three_transfers(rx, tx, src, dst) -> list[str]:
    outcomes = []
    for tid in ("a", "b", "c"):
        pending = rx.reserve(tid, 2, timeout_s=5)
        try:
            await tx.finish(pending.descriptor, first_token=1, blocks=[3, 4])  # one chunk, carrying the finish
            done = await pending
            same = torch.equal(dst[list(done.block_ids)], src[[3, 4]])
            outcomes.append("ok" if same else "wrong KV")
        except TransferError as e:
            outcomes.append("failed")
            assert "corrupted" in str(e)
            with pytest.raises(TransferError, match="corrupted"):
                await pending
    return outcomes


def test_a_corrupted_chunk_fails_its_transfer_and_frees_its_blocks(monkeypatch):
    monkeypatch.setenv("PDSERVE_KV_FAULTS", "corrupt:2")

    async def go():
        src, dst, pool, rx, tx = await _pair()
        assert await _three_transfers(rx, tx, src, dst) == ["ok", "failed", "ok"]
        assert rx.faults.injected == 1 and pool.released == ["b"] and rx.open_transfers == 0
        await rx.close()

    asyncio.run(go())


def test_without_checksums_the_same_corruption_goes_unnoticed(monkeypatch):
    """What the check buys: a sender with checksums off hands over the damaged KV as if it were fine."""
    monkeypatch.setenv("PDSERVE_KV_FAULTS", "corrupt:2")

    async def go():
        src, dst, pool, rx, tx = await _pair(checksum=False)
        assert await _three_transfers(rx, tx, src, dst) == ["ok", "wrong KV", "ok"]
        await rx.close()

    asyncio.run(go())
