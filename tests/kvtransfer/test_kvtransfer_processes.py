"""KV transfers between real processes over loopback, for UCX and TCP.

Every test ends with the leak check: the receiver's block pool is back to all
free (a completed transfer's blocks are freed by "finishing the sequence", as
the decode engine would; a failed one's by the receiver through its owner).
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import time

import pytest
from kvt_peer import NUM_BLOCKS, SPEC, Peer, RemoteError

from kvtransfer import TransferDescriptor
from services.engine.kv_cache import KVCacheSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]
ALL_FREE = NUM_BLOCKS - 1


@pytest.fixture(scope="module", params=["ucx", "ucx-put", "tcp"])
def transport(request):
    if request.param.startswith("ucx"):
        pytest.importorskip("ucxx", reason="the ucx transport needs ucxx (pip install ucxx-cu12)")
    return request.param


@pytest.fixture(scope="module")
def receiver(transport):
    peer = Peer("receiver", transport, op_timeout_s=10)
    yield peer
    peer.close()


@pytest.fixture(scope="module")
def sender(transport):
    peer = Peer("sender", transport, seed=1, op_timeout_s=10)
    yield peer
    peer.close()


def _plan(rng: random.Random, desc: bytes, src_pool: list[int], chunks: int):
    """Scattered source blocks for one transfer, sent in ``chunks`` pieces."""
    d = TransferDescriptor.from_bytes(desc)
    src = rng.sample(src_pool, d.num_blocks)
    for b in src:
        src_pool.remove(b)
    bounds = sorted({0, d.num_blocks, *rng.sample(range(1, d.num_blocks), min(chunks, d.num_blocks) - 1)})
    pieces = [(src[a:b], a) for a, b in itertools.pairwise(bounds)]
    return d, src, pieces


def _check_delivered(receiver, sender, d, src, first_token, spec=SPEC):
    out = receiver.call("outcome", d.transfer_id)
    assert out["first_token"] == first_token and out["meta"] == {"by": "test"}
    assert out["nbytes"] == len(src) * spec.block_bytes
    assert receiver.call("digests", list(d.block_ids)) == sender.call("digests", src)
    receiver.call("finish_sequence", d.transfer_id)


def test_concurrent_transfers_between_one_pair(receiver, sender):
    rng = random.Random(7)
    src_pool = list(range(1, NUM_BLOCKS))
    jobs, plans = [], []
    for i in range(8):
        desc = receiver.call("reserve", f"req-{i}", rng.randint(1, 7), 20.0)
        d, src, pieces = _plan(rng, desc, src_pool, chunks=3)
        jobs.append((desc, pieces, 100 + i))
        plans.append((d, src, 100 + i))
    assert sender.call("send_many", jobs) == [None] * 8
    for d, src, token in plans:
        _check_delivered(receiver, sender, d, src, token)
    assert receiver.call("free") == ALL_FREE


def test_put_share_of_the_bytes(receiver, sender, transport):
    # ucx-put: the sender writes half of each message's bytes itself, straight into
    # the reserved blocks, while the receiver pulls the other half; plain ucx pulls
    # messages this small whole.
    if transport == "tcp":
        pytest.skip("TCP has no puts")
    before = sender.call("traffic")
    desc = receiver.call("reserve", "halves", 7, 20.0)
    d, src, pieces = _plan(random.Random(5), desc, list(range(1, NUM_BLOCKS)), chunks=2)
    sender.call("send", desc, pieces, 4)
    _check_delivered(receiver, sender, d, src, 4)
    after = sender.call("traffic")
    sent, put = after["sent_bytes"] - before["sent_bytes"], after["put_bytes"] - before["put_bytes"]
    assert sent == 7 * SPEC.block_bytes
    want = sum(len(chunk) * SPEC.block_bytes // 2 for chunk, _ in pieces) if transport == "ucx-put" else 0
    assert put == want
    assert receiver.call("free") == ALL_FREE


def test_stale_put_grant_is_never_used():
    # A grant lets the sender start its puts for half the receiver's drain grace; a
    # failed transfer's blocks are released only after that grace. Here every grant
    # is stale on arrival: the sender must refuse to write, and both sides fail cleanly.
    pytest.importorskip("ucxx", reason="the ucx transport needs ucxx (pip install ucxx-cu12)")
    receiver = Peer("receiver", "ucx-put", drain_grace_s=1e-6)
    sender = Peer("sender", "ucx-put")
    try:
        desc = receiver.call("reserve", "stale", 4, 30.0)
        with pytest.raises(RemoteError, match="TransferError: .*put grant expired"):
            sender.call("send", desc, [([1, 2, 3, 4], 0)], 0)
        assert sender.call("traffic")["put_bytes"] == 0
        with pytest.raises(RemoteError, match="sender .* disconnected mid-transfer"):
            receiver.call("outcome", "stale")
        assert receiver.call("free") == ALL_FREE
    finally:
        sender.close()
        receiver.close()


def test_two_senders_to_one_receiver(receiver, sender, transport):
    other = Peer("sender", transport, seed=2)
    try:
        rng = random.Random(11)
        started = []
        for peer in (sender, other):
            src_pool = list(range(1, NUM_BLOCKS))
            jobs = []
            for i in range(4):
                desc = receiver.call("reserve", f"{id(peer)}-{i}", rng.randint(2, 6), 20.0)
                d, src, pieces = _plan(rng, desc, src_pool, chunks=2)
                jobs.append((desc, pieces, i))
                started.append((peer, d, src, i))
            peer.job = peer.start("send_many", jobs)
        for peer in (sender, other):
            assert peer.result(peer.job) == [None] * 4
        for peer, d, src, token in started:
            _check_delivered(receiver, peer, d, src, token)
        assert receiver.call("free") == ALL_FREE
    finally:
        other.close()


def test_transfer_timeout_fails_both_sides(receiver, sender):
    desc = receiver.call("reserve", "slow", 4, 0.5)
    d = TransferDescriptor.from_bytes(desc)
    sender.call("send", desc, [([1, 2], 0)], None)  # half the blocks, then the prefill "stalls"
    with pytest.raises(RemoteError, match="timed out after 0.5s .2 of 4 blocks received"):
        receiver.call("outcome", d.transfer_id)
    assert receiver.call("free") == ALL_FREE
    with pytest.raises(RemoteError, match="TransferError: .*slow.*timed out"):
        sender.call("send", desc, [([3, 4], 2)], 5)


def test_receiver_without_free_blocks(receiver, sender):
    desc = receiver.call("reserve", "big", ALL_FREE, 20.0)
    with pytest.raises(RemoteError, match="CapacityError: no room for 1 KV blocks"):
        receiver.call("reserve", "one-more", 1, 20.0)
    # A sender handed a descriptor for the refused reservation gets a clear error too.
    d = TransferDescriptor.from_bytes(desc)
    ghost = TransferDescriptor(d.address, "one-more", (1,), d.peer).to_bytes()
    with pytest.raises(RemoteError, match="TransferError: .*unknown transfer one-more"):
        sender.call("send", ghost, [([1], 0)], 0)
    receiver.call("cancel", "big")
    with pytest.raises(RemoteError, match="big cancelled"):
        receiver.call("outcome", "big")
    assert receiver.call("free") == ALL_FREE


@pytest.mark.parametrize(
    "change, field",
    [({"spec": KVCacheSpec(4, 2, 64, 16, "float16")}, "dtype"), ({"namespace": "test/other-model"}, "namespace")],
)
def test_mismatched_peer_is_refused(receiver, transport, change, field):
    odd = Peer("sender", transport, **change)
    try:
        desc = receiver.call("reserve", f"mismatch-{field}", 2, 30.0)
        with pytest.raises(RemoteError, match=f"TransferError: .*incompatible KV peer.*{field}: ours="):
            odd.call("send", desc, [([1, 2], 0)], 0)
        # The receiver fails the transfer with the same reason at once, not by its timeout.
        with pytest.raises(RemoteError, match=f"incompatible KV peer.*{field}"):
            receiver.call("outcome", f"mismatch-{field}")
        assert receiver.call("stats")["refused_peers"] >= 1
        assert receiver.call("free") == ALL_FREE
    finally:
        odd.close()


def test_idle_connection_costs_no_cpu(receiver, sender):
    # With ucxx's own blocking progress, a process that had moved KV over UCX kept
    # polling afterwards: about 0.9 s of CPU per idle second, on a 2-core machine.
    desc = receiver.call("reserve", "before-idle", 2, 20.0)
    sender.call("send", desc, [([1, 2], 0)], 0)
    receiver.call("outcome", "before-idle")
    receiver.call("finish_sequence", "before-idle")
    assert receiver.call("idle_cpu", 1.0) < 0.25
    assert sender.call("idle_cpu", 1.0) < 0.25


def test_sender_killed_mid_transfer(transport):
    receiver = Peer("receiver", transport)
    doomed = Peer("sender", transport)
    try:
        desc = receiver.call("reserve", "orphan", 6, 30.0)
        doomed.call("send", desc, [([1, 2, 3], 0)], None)
        doomed.kill()
        with pytest.raises(RemoteError, match="sender .* disconnected mid-transfer"):
            receiver.call("outcome", "orphan", timeout=20)
        assert receiver.call("free") == ALL_FREE
    finally:
        doomed.close()
        receiver.close()


def test_receiver_killed_mid_transfer(transport):
    receiver = Peer("receiver", transport)
    sender = Peer("sender", transport, op_timeout_s=10)
    try:
        desc = receiver.call("reserve", "headless", 6, 30.0)
        sender.call("send", desc, [([1, 2, 3], 0)], None)
        receiver.kill()
        with pytest.raises(RemoteError, match="TransferError: .*(lost|closed|failed|connect)"):
            sender.call("send", desc, [([4, 5, 6], 3)], 9, timeout=30)
        assert sender.call("stats")["failed"] == 1
    finally:
        sender.close()
        receiver.close()


# 2 MiB blocks: the cancelled transfer's one chunk (40 blocks, 80 MiB) is more than loopback's
# socket buffers hold (tcp_rmem's 32 MiB at most, plus tcp_wmem's 4), so while the receiver is
# stopped its writer is stuck part-way through the payload.
BIG_BLOCKS = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=1024, dtype="bfloat16")


def test_cancelled_send_leaves_the_other_transfers_on_its_connection_intact():
    """A request aborted while its KV is being sent (client gone) cancels its send part-way;
    the six transfers queued behind it on the same connection to the receiver must all land
    with the right bytes. Before, the cancel closed that shared connection and every other
    transfer on it failed with "[Errno 9] Bad file descriptor" (the flaky profile stack test).
    TCP only: UCX still closes its connection on a cancelled send (unchanged)."""
    receiver = Peer("receiver", "tcp", spec=BIG_BLOCKS)
    # the sender may wait this long for the stuck writer to stop at a segment boundary
    sender = Peer("sender", "tcp", spec=BIG_BLOCKS, seed=3, drain_grace_s=60)
    try:
        address = receiver.call("address")
        sender.call("connect", address)
        victim = receiver.call("reserve", "victim", 40, 120.0)
        jobs, plans = [(victim, [(list(range(1, 41)), 0)], 7)], []
        for i in range(6):
            desc = receiver.call("reserve", f"other-{i}", 3, 120.0)
            src = [41 + 3 * i, 42 + 3 * i, 43 + 3 * i]
            jobs.append((desc, [(src[:1], 0), (src[1:], 1)], 100 + i))
            plans.append((TransferDescriptor.from_bytes(desc), src, 100 + i))
        os.kill(receiver.process.pid, signal.SIGSTOP)  # a stalled receiver: nothing is read
        try:
            sender.call("start_sends", jobs)
            time.sleep(1.0)  # the victim's writer is stuck mid-payload (or still queued: same outcome due)
            cancel = sender.start("cancel_send", "victim")
            time.sleep(0.5)
        finally:
            os.kill(receiver.process.pid, signal.SIGCONT)
        assert sender.result(cancel, timeout=60) == "CancelledError"
        assert sender.call("await_sends", [d.transfer_id for d, _, _ in plans], timeout=60) == [None] * 6
        for d, src, token in plans:
            _check_delivered(receiver, sender, d, src, token, BIG_BLOCKS)
        with pytest.raises(RemoteError, match="victim .*(abandoned by the sender|aborted by the sender)"):
            receiver.call("outcome", "victim", timeout=30)
        assert receiver.call("free") == ALL_FREE
        assert sender.call("stats")["failed"] == 1
    finally:
        sender.close()
        receiver.close()
