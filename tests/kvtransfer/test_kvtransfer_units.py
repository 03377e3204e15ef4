"""Descriptor, compatibility check, block runs, stats, config and transport choice."""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace

import pytest
import torch

from kvtransfer import BlockShape, PeerInfo, TransferConfig, TransferDescriptor, TransferError, TransferStats, make_transport
from kvtransfer.block_runs import BlockBytes, Run, coalesce
from kvtransfer.tcp import TcpTransport
from kvtransfer.ucx_puts import PutPolicy, Puts, UcxTraffic, put_sizes
from services.engine.kv_cache import KVCacheSpec, allocate_kv_cache

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")
SHAPE = BlockShape(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")


def test_block_shape_read_off_the_engine_cache_is_the_engine_spec():
    # kvtransfer imports nothing from the engine: it reads the block shape off the tensor,
    # so the engine's layout (services/engine/kv_cache.py) and descriptor.LAYOUT must agree
    assert BlockShape.of(allocate_kv_cache(SPEC, 3)) == SHAPE
    assert BlockShape.of(allocate_kv_cache(KVCacheSpec(3, 1, 16, 8, "float32"), 2)) == BlockShape(3, 1, 16, 8, "float32")
    with pytest.raises(ValueError, match="not laid out"):
        BlockShape.of(torch.zeros(4, 2, 3, 4, 2, 8))


def test_descriptor_round_trips_through_bytes():
    d = TransferDescriptor("ucx://10.0.0.5:4242", "req-1", (7, 3, 9), PeerInfo("smollm2", SHAPE))
    again = TransferDescriptor.from_bytes(d.to_bytes())
    assert again == d
    assert again.peer.shape == SHAPE


@pytest.mark.parametrize("blocks", [(), (0, 1), (3, 3)])
def test_descriptor_rejects_bad_block_lists(blocks):
    with pytest.raises(ValueError):
        TransferDescriptor("tcp://h:1", "t", blocks, PeerInfo("m", SHAPE))


def test_malformed_descriptor_is_a_transfer_error():
    with pytest.raises(TransferError, match="malformed transfer descriptor"):
        TransferDescriptor.from_bytes(b'{"address": "tcp://h:1"}')
    with pytest.raises(TransferError, match="malformed"):
        TransferDescriptor.from_bytes(b"\xff not json")


def test_compatibility_check_names_every_mismatch():
    ours = PeerInfo("smollm2", SHAPE)
    theirs = PeerInfo("llama", BlockShape(2, 4, 8, 16, "float16"))
    with pytest.raises(TransferError) as e:
        ours.check_compatible(theirs, peer="tcp://x:1")
    msg = str(e.value)
    for field in ("namespace", "num_kv_heads", "block_size", "dtype"):
        assert f"{field}: ours=" in msg
    assert "num_layers" not in msg and "head_dim" not in msg
    ours.check_compatible(PeerInfo("smollm2", SHAPE), peer="tcp://x:1")  # equal peers pass


def test_layout_string_is_part_of_the_check():
    assert PeerInfo("m", SHAPE).mismatches(PeerInfo("m", SHAPE, layout="kv[layer,block,...]")) == [
        "layout: ours='kv[block,layer,kv,slot,head,dim]' theirs='kv[layer,block,...]'"
    ]


def test_coalesce_breaks_runs_where_either_side_jumps():
    assert coalesce([7, 8, 9, 12, 13, 14], [3, 4, 5, 9, 10, 20]) == [Run(7, 3, 3), Run(12, 9, 2), Run(14, 20, 1)]
    assert coalesce([1, 2, 3], [5, 6, 7]) == [Run(1, 5, 3)]
    assert coalesce([3, 2, 1], [1, 2, 3]) == [Run(3, 1, 1), Run(2, 2, 1), Run(1, 3, 1)]
    assert coalesce([], []) == []
    with pytest.raises(ValueError):
        coalesce([1], [1, 2])


def test_block_bytes_views_alias_the_cache():
    kv = allocate_kv_cache(SPEC, 8)
    blocks = BlockBytes(kv)
    view = blocks.run(2, 3)
    assert view.numel() == 3 * SPEC.block_bytes and view.dtype == torch.uint8
    view.fill_(0xFF)  # writing the view writes blocks 2..4 of the cache, nothing else
    touched = (kv.view(8, -1).view(torch.uint8) != 0).any(dim=1).tolist()
    assert touched == [False, False, True, True, True, False, False, False]
    with pytest.raises(ValueError):
        blocks.run(0, 1)  # the null block is never moved
    with pytest.raises(ValueError):
        blocks.run(6, 3)
    with pytest.raises(ValueError, match="contiguous"):
        BlockBytes(allocate_kv_cache(SPEC, 16)[::2])


def test_stats_histograms_are_cumulative():
    s = TransferStats()
    s.record_success(1 << 20, 0.004)
    s.record_success(1 << 30, 2.0)
    s.record_failure(timeout=True)
    s.record_failure()
    snap = s.snapshot()
    assert (snap["completed"], snap["failed"], snap["timeouts"]) == (2, 2, 1)
    assert snap["bytes_total"] == (1 << 20) + (1 << 30)
    assert snap["seconds"]["buckets"]["0.005"] == 1 and snap["seconds"]["buckets"]["2.5"] == 2
    assert snap["seconds"]["buckets"]["+Inf"] == snap["seconds"]["count"] == 2


@pytest.mark.parametrize(
    "sizes, share, want",
    [
        ([10, 10, 10, 10], 0.5, [0, 0, 10, 10]),  # cut between buffers: each moved whole by one side
        ([30], 0.5, [15]),  # one run: its tail is put
        ([10, 25], 0.5, [0, 17]),  # the buffer across the cut is split
        ([7, 3], 1.0, [7, 3]),
        ([7, 3], 0.0, [0, 0]),
    ],
)
def test_put_sizes_cut_a_message_once(sizes, share, want):
    assert put_sizes(sizes, share) == want


@pytest.mark.parametrize(
    "kwargs",
    [
        {"transport": "rdma"},
        {"port": 70000},
        {"op_timeout_s": 0},
        {"host": ""},
        {"ucx_put_share": 1.5},
        {"ucx_put_min_bytes": 0},
    ],
)
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        TransferConfig(**kwargs)


def test_every_configurable_transport_is_registered_by_its_name():
    from kvtransfer.config import TRANSPORTS as NAMES
    from kvtransfer.loopback import LoopbackTransport
    from kvtransfer.registry import TRANSPORTS

    assert set(TRANSPORTS) == set(NAMES)
    assert isinstance(make_transport(TransferConfig(transport="tcp")), TcpTransport)
    assert isinstance(make_transport(TransferConfig(transport="loopback")), LoopbackTransport)


def test_missing_ucx_is_a_clear_error_unless_fallback_allowed(monkeypatch, caplog):
    monkeypatch.delitem(sys.modules, "ucxx", raising=False)
    monkeypatch.setitem(sys.modules, "ucxx", None)  # import ucxx now raises ImportError
    with pytest.raises(TransferError, match="needs the ucxx package.*tcp transport"):
        make_transport(TransferConfig(transport="ucx"))
    assert isinstance(make_transport(TransferConfig(transport="ucx", allow_fallback=True)), TcpTransport)
    assert "falling back to the TCP KV transport" in caplog.text


def test_ucx_delivers_the_headers_its_peer_sent_before_closing(monkeypatch):
    # A refused sender aborts its transfer and closes at once; the receiver must still
    # read that abort (or the transfer waits for its timeout), as it would over TCP.
    # UCX itself is not needed: the headers travel on the TCP control connection.
    from kvtransfer import ucx  # imports no ucxx

    monkeypatch.setattr(ucx, "progress_driver", lambda: SimpleNamespace(settle=lambda: None))

    async def go():
        accepted: asyncio.Queue = asyncio.Queue()
        done = asyncio.Event()

        async def on_connection(conn):
            await accepted.put(conn)
            await done.wait()

        tcp = TcpTransport()
        listener = await tcp.listen("127.0.0.1", 0, on_connection)
        ctrl = await tcp.connect(listener.address, 5.0)
        peer = await accepted.get()
        stub_ucxx = SimpleNamespace(exceptions=SimpleNamespace(UCXError=RuntimeError))
        endpoint = SimpleNamespace(_ep=None, abort=lambda: None)
        puts = Puts(PutPolicy(), None, 0, False, False, UcxTraffic())
        conn = ucx.UcxConnection(stub_ucxx, ctrl, endpoint, 1, 2, "ucx://peer", puts)
        await peer.send_header({"type": "abort", "transfer_id": "t"})
        peer.close()
        for _ in range(500):
            if conn.closed:
                break
            await asyncio.sleep(0.01)
        assert conn.closed  # the peer's close was seen before anyone read the abort
        assert (await conn.recv())["type"] == "abort"
        with pytest.raises(TransferError):
            await conn.recv()
        with pytest.raises(TransferError):
            await conn.recv()
        done.set()
        await listener.close()

    asyncio.run(go())


def test_tcp_headers_stay_in_order_behind_a_payload_being_written():
    """Headers go out from the event loop unless a payload is still being written: then they
    queue behind it. A slow reader fills the socket buffer; everything arrives intact, in order."""
    from kvtransfer.protocol import payload_sizes

    big = torch.randint(0, 256, (32 << 20,), dtype=torch.uint8)

    async def go():
        transport, got = TcpTransport(), asyncio.Queue()

        async def on_connection(conn):
            while True:
                try:
                    header = await conn.recv()
                except TransferError:
                    return
                buf = None
                if payload_sizes(header):
                    await asyncio.sleep(0.3)  # the sender's socket buffer is full by now
                    buf = torch.empty(payload_sizes(header)[0], dtype=torch.uint8)
                    await conn.recv_payload(header, [buf])
                await got.put((header["n"], buf))

        listener = await transport.listen("127.0.0.1", 0, on_connection)
        conn = await transport.connect(listener.address, 5)
        await asyncio.gather(conn.send({"type": "x", "n": 1}, [big]),
                             conn.send_header({"type": "x", "n": 2}), conn.send_header({"type": "x", "n": 3}))
        await conn.send_header({"type": "x", "n": 4})  # the writer is idle again: straight from the loop
        arrived = [await asyncio.wait_for(got.get(), 10) for _ in range(4)]
        conn.close()
        await listener.close()
        return arrived

    arrived = asyncio.run(go())
    assert [n for n, _ in arrived] == [1, 2, 3, 4]
    assert torch.equal(arrived[0][1], big) and all(buf is None for _, buf in arrived[1:])


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_tcp_payload_crosses_a_socket_the_event_loop_made_non_blocking(loop):
    """uvloop's add_reader (each side waits for headers on the loop: the sender for acks, the receiver
    for the next message) leaves the socket non-blocking for the writer and reader threads too. A payload
    larger than the socket buffers, read late, still arrives whole on both event loops (before, the
    threads failed with "[Errno 11] Resource temporarily unavailable" and the hand-off was lost)."""
    from kvtransfer.protocol import payload_sizes

    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
    big = torch.randint(0, 256, (32 << 20,), dtype=torch.uint8)

    async def go():
        transport, got = TcpTransport(), asyncio.Queue()

        async def on_connection(conn):
            header = await conn.recv()
            await asyncio.sleep(0.3)  # the sender's writer meets a full socket buffer meanwhile
            buf = torch.empty(payload_sizes(header)[0], dtype=torch.uint8)
            await conn.recv_payload(header, [buf])
            await conn.send_header({"type": "ack"})
            await got.put(buf)

        listener = await transport.listen("127.0.0.1", 0, on_connection)
        conn = await transport.connect(listener.address, 5)
        ack = asyncio.ensure_future(conn.recv())  # waits on the loop while the payload is written
        await asyncio.sleep(0.05)
        await conn.send({"type": "blocks"}, [big])
        arrived = await asyncio.wait_for(got.get(), 10)
        assert (await asyncio.wait_for(ack, 10))["type"] == "ack"
        conn.close()
        await listener.close()
        return arrived

    arrived = uvloop.run(go()) if loop == "uvloop" else asyncio.run(go())
    assert torch.equal(arrived, big)


def test_tcp_send_cancelled_mid_payload_leaves_the_connection_in_step():
    """A send cancelled while its payload is being written stops at a segment boundary and marks
    the message abandoned: the reader's recv_payload says so, and the messages queued behind it
    on the same connection arrive intact. 96 MiB is more than loopback's socket buffers hold
    (tcp_rmem's 32 MiB at most, plus tcp_wmem's 4): once the reader has the header and reads no
    payload, the writer is stuck part-way through it."""
    from kvtransfer.protocol import payload_sizes

    big = torch.randint(0, 256, (96 << 20,), dtype=torch.uint8)
    small = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)

    async def go():
        transport, got, headed, proceed = TcpTransport(), asyncio.Queue(), asyncio.Queue(), asyncio.Event()

        async def on_connection(conn):
            while True:
                try:
                    header = await conn.recv()
                except TransferError as e:
                    await got.put(("recv", e))
                    return
                await headed.put(header["n"])
                await proceed.wait()
                buf = torch.zeros(payload_sizes(header)[0], dtype=torch.uint8)
                try:
                    await conn.recv_payload(header, [buf])
                except TransferError as e:
                    await got.put((header["n"], e))
                    continue
                await got.put((header["n"], buf))

        listener = await transport.listen("127.0.0.1", 0, on_connection)
        conn = await transport.connect(listener.address, 5)
        victim = asyncio.ensure_future(conn.send({"type": "x", "n": 1}, [big]))
        assert await asyncio.wait_for(headed.get(), 10) == 1  # its payload is being written now
        behind = asyncio.ensure_future(conn.send({"type": "x", "n": 2}, [small]))
        await asyncio.sleep(0)
        victim.cancel()
        proceed.set()
        with pytest.raises(asyncio.CancelledError):
            await victim
        await asyncio.wait_for(behind, 10)
        await conn.send({"type": "x", "n": 3}, [small[:5]])
        arrived = [await asyncio.wait_for(got.get(), 10) for _ in range(3)]
        still_open = not conn.closed
        conn.close()
        await listener.close()
        return arrived, still_open

    arrived, still_open = asyncio.run(go())
    (n1, abandoned), (n2, second), (n3, third) = arrived
    assert (n1, n2, n3) == (1, 2, 3)
    assert isinstance(abandoned, TransferError) and "abandoned" in str(abandoned)
    assert torch.equal(second, small) and torch.equal(third, small[:5])
    assert still_open
