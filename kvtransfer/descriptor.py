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

from kvtransfer.errors import TransferError

# Names the dimension order of the KV cache tensor (services/engine/kv_cache.py):
# kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]. A peer that
# lays out its cache differently must use another string, so a mix-up is refused
# at connect time instead of silently scrambling layers and heads.
LAYOUT = "kv[block,layer,kv,slot,head,dim]"
_SHAPE_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "block_size")


@dataclass(frozen=True)
class BlockShape:
    """What a KV block is, as both peers must see it; read off the cache tensor itself."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # torch's name without "torch.": "bfloat16", "float32", ...

    def __post_init__(self) -> None:
        if min(getattr(self, f) for f in _SHAPE_FIELDS) < 1 or not self.dtype:
            raise ValueError(f"not a KV block shape: {self}")

    @classmethod
    def of(cls, kv) -> BlockShape:
        """The shape of ``kv``'s blocks (a tensor laid out as ``LAYOUT``)."""
        if kv.dim() != 6 or kv.shape[2] != 2:
            raise ValueError(f"KV tensor of shape {tuple(kv.shape)} is not laid out as {LAYOUT}")
        _, layers, _, block_size, heads, head_dim = kv.shape
        return cls(layers, heads, head_dim, block_size, str(kv.dtype).removeprefix("torch."))


@dataclass(frozen=True)
class PeerInfo:
    namespace: str  # model identity (e.g. model name + revision, + LoRA); must match exactly
    shape: BlockShape
    layout: str = LAYOUT

    def __post_init__(self) -> None:
        if not self.namespace:
            raise ValueError("PeerInfo.namespace must not be empty")

    def to_dict(self) -> dict:
        return {"namespace": self.namespace, "layout": self.layout,
                **{f: getattr(self.shape, f) for f in (*_SHAPE_FIELDS, "dtype")}}

    @classmethod
    def from_dict(cls, d: dict) -> PeerInfo:
        try:
            shape = BlockShape(*(int(d[f]) for f in _SHAPE_FIELDS), dtype=str(d["dtype"]))
            return cls(namespace=str(d["namespace"]), shape=shape, layout=str(d["layout"]))
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
