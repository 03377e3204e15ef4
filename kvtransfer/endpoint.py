"""What both ends of a transfer hold: config, transport, stats, this side's PeerInfo, the cache as bytes."""

from __future__ import annotations

import torch

from kvtransfer.block_runs import BlockBytes
from kvtransfer.config import TransferConfig
from kvtransfer.descriptor import BlockShape, PeerInfo
from kvtransfer.registry import make_transport
from kvtransfer.stats import TransferStats
from kvtransfer.transport import Transport


class Endpoint:
    """Base of ``Receiver`` and ``Sender``: ``kv_cache`` is laid out as ``descriptor.LAYOUT``; the peer
    check compares ``namespace`` and the block shape read off it. ``transport`` and ``stats`` may be
    shared (tests pair a loopback receiver and sender on one transport)."""

    def __init__(self, kv_cache: torch.Tensor, namespace: str, config: TransferConfig | None,
                 transport: Transport | None, stats: TransferStats | None):
        self.config = config or TransferConfig()
        self.transport = transport or make_transport(self.config)
        self.stats = stats or TransferStats()
        self.peer = PeerInfo(namespace, BlockShape.of(kv_cache))
        self._blocks = BlockBytes(kv_cache)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of the cache (every layer's K and V)."""
        return self._blocks.block_bytes
