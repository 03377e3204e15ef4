"""What two peers must agree on, and the descriptor of one reserved destination.

``PeerInfo`` is exchanged when a sender connects (``hello`` / ``welcome``, see
``protocol.py``); ``check_compatible`` refuses a peer whose KV blocks would be
misread: another model namespace, dtype, block size, head count, head size,
layer count or tensor layout. The number of blocks each side has may differ,
and so may the device (UCX moves host <-> CUDA memory).

``TransferDescriptor`` is what the decode side hands to the prefill side
(through the router) after it reserved blocks: where to connect, which
transfer id to quote, and which destination block ids to fill, in prompt
order. It is opaque to everyone but kvtransfer and round-trips through
``to_bytes`` / ``from_bytes`` (JSON, so it can also travel in a proto
``bytes`` field or a Redis stream entry).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from services.engine.kv_cache import KVCacheSpec
from services.errors import TransferError

# Names the dimension order of services/engine/kv_cache.py. A peer that lays out
# its cache differently must use another string, so a mix-up is refused at
# connect time instead of silently scrambling layers and heads.
LAYOUT = "kv[block,layer,kv,slot,head,dim]"


@dataclass(frozen=True)
class PeerInfo:
    namespace: str  # model identity (e.g. model name + revision, + LoRA); must match exactly
    spec: KVCacheSpec
    layout: str = LAYOUT

    def __post_init__(self) -> None:
        if not self.namespace:
            raise ValueError("PeerInfo.namespace must not be empty")

    def to_dict(self) -> dict:
        s = self.spec
        return {
            "namespace": self.namespace,
            "layout": self.layout,
            "num_layers": s.num_layers,
            "num_kv_heads": s.num_kv_heads,
            "head_dim": s.head_dim,
            "block_size": s.block_size,
            "dtype": s.dtype,
        }

    @classmethod
    def from_dict(cls, d: dict) -> PeerInfo:
        try:
            spec = KVCacheSpec(
                num_layers=int(d["num_layers"]),
                num_kv_heads=int(d["num_kv_heads"]),
                head_dim=int(d["head_dim"]),
                block_size=int(d["block_size"]),
                dtype=str(d["dtype"]),
            )
            return cls(namespace=str(d["namespace"]), spec=spec, layout=str(d["layout"]))
        except (KeyError, TypeError, ValueError) as e:
            raise TransferError(f"malformed peer description {d!r}: {e}") from None

    def mismatches(self, other: PeerInfo) -> list[str]:
        """Human-readable differences that make the two KV caches incompatible."""
        ours, theirs = self.to_dict(), other.to_dict()
        return [f"{k}: ours={ours[k]!r} theirs={theirs[k]!r}" for k in ours if ours[k] != theirs[k]]

    def check_compatible(self, other: PeerInfo, *, peer: str) -> None:
        diffs = self.mismatches(other)
        if diffs:
            raise TransferError(f"incompatible KV peer {peer}: " + "; ".join(diffs))


@dataclass(frozen=True)
class TransferDescriptor:
    address: str  # "ucx://host:port", "tcp://host:port" or "loopback://name"
    transfer_id: str
    block_ids: tuple[int, ...]  # destination blocks, in prompt order
    peer: PeerInfo  # the receiver's side of the compatibility check

    def __post_init__(self) -> None:
        if not self.transfer_id:
            raise ValueError("transfer_id must not be empty")
        if not self.block_ids:
            raise ValueError("a transfer needs at least one destination block")
        if min(self.block_ids) < 1:
            raise ValueError("block 0 is the null block and is never a transfer destination")
        if len(set(self.block_ids)) != len(self.block_ids):
            raise ValueError("destination block ids must be distinct")

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def to_dict(self) -> dict:
        return {
            "address": self.address,
            "transfer_id": self.transfer_id,
            "block_ids": list(self.block_ids),
            "peer": self.peer.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> TransferDescriptor:
        try:
            return cls(
                address=str(d["address"]),
                transfer_id=str(d["transfer_id"]),
                block_ids=tuple(int(b) for b in d["block_ids"]),
                peer=PeerInfo.from_dict(d["peer"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise TransferError(f"malformed transfer descriptor: {e}") from None

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> TransferDescriptor:
        try:
            d = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TransferError(f"malformed transfer descriptor: {e}") from None
        return cls.from_dict(d)
