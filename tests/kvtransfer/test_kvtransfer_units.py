"""Descriptor, compatibility check, block runs, stats, config and transport choice."""

from __future__ import annotations

import sys

import pytest
import torch

from kvtransfer import PeerInfo, TransferConfig, TransferDescriptor, TransferStats, make_transport
from kvtransfer.block_runs import BlockBytes, Run, coalesce
from kvtransfer.tcp import TcpTransport
from services.engine.kv_cache import KVCacheSpec, allocate_kv_cache
from services.errors import TransferError

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")


def test_descriptor_round_trips_through_bytes():
    d = TransferDescriptor("ucx://10.0.0.5:4242", "req-1", (7, 3, 9), PeerInfo("smollm2", SPEC))
    again = TransferDescriptor.from_bytes(d.to_bytes())
    assert again == d
    assert again.peer.spec.block_bytes == SPEC.block_bytes


@pytest.mark.parametrize("blocks", [(), (0, 1), (3, 3)])
def test_descriptor_rejects_bad_block_lists(blocks):
    with pytest.raises(ValueError):
        TransferDescriptor("tcp://h:1", "t", blocks, PeerInfo("m", SPEC))


def test_malformed_descriptor_is_a_transfer_error():
    with pytest.raises(TransferError, match="malformed transfer descriptor"):
        TransferDescriptor.from_bytes(b'{"address": "tcp://h:1"}')
    with pytest.raises(TransferError, match="malformed"):
        TransferDescriptor.from_bytes(b"\xff not json")


def test_compatibility_check_names_every_mismatch():
    ours = PeerInfo("smollm2", SPEC)
    theirs = PeerInfo("llama", KVCacheSpec(2, 4, 8, 16, "float16"))
    with pytest.raises(TransferError) as e:
        ours.check_compatible(theirs, peer="tcp://x:1")
    msg = str(e.value)
    for field in ("namespace", "num_kv_heads", "block_size", "dtype"):
        assert f"{field}: ours=" in msg
    assert "num_layers" not in msg and "head_dim" not in msg
    ours.check_compatible(PeerInfo("smollm2", SPEC), peer="tcp://x:1")  # equal peers pass


def test_layout_string_is_part_of_the_check():
    assert PeerInfo("m", SPEC).mismatches(PeerInfo("m", SPEC, layout="kv[layer,block,...]")) == [
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
    blocks = BlockBytes(kv, SPEC)
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
        BlockBytes(allocate_kv_cache(SPEC, 16)[::2], SPEC)


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


@pytest.mark.parametrize("kwargs", [{"transport": "rdma"}, {"port": 70000}, {"op_timeout_s": 0}, {"host": ""}])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        TransferConfig(**kwargs)


def test_missing_ucx_is_a_clear_error_unless_fallback_allowed(monkeypatch, caplog):
    monkeypatch.delitem(sys.modules, "ucxx", raising=False)
    monkeypatch.setitem(sys.modules, "ucxx", None)  # import ucxx now raises ImportError
    with pytest.raises(TransferError, match="needs the ucxx package.*tcp transport"):
        make_transport(TransferConfig(transport="ucx"))
    assert isinstance(make_transport(TransferConfig(transport="ucx", allow_fallback=True)), TcpTransport)
    assert "falling back to the TCP KV transport" in caplog.text
