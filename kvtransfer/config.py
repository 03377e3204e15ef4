"""Typed configuration of the KV transfer layer (built from CLI/env by services/config.py)."""

from __future__ import annotations

from dataclasses import dataclass

TRANSPORTS = ("ucx", "tcp", "loopback")


@dataclass(frozen=True)
class TransferConfig:
    transport: str = "ucx"
    # UCX missing (ucxx not installed, or it fails to initialise): use TCP
    # instead of failing. Off by default so a deployment that expects UCX
    # speed learns at start-up, not from a slow TTFT dashboard.
    allow_fallback: bool = False
    host: str = "127.0.0.1"  # receiver: address to listen on and advertise in descriptors
    advertise_host: str = ""  # receiver: advertise this instead (host is a wildcard, e.g. in a container)
    port: int = 0  # receiver: 0 picks a free port
    connect_timeout_s: float = 10.0
    # Sender: a chunk, a finish or its acknowledgement that takes longer than this
    # fails the transfer (and drops the connection, since a half-sent message
    # cannot be taken back).
    op_timeout_s: float = 60.0
    # Receiver: after a transfer fails while a chunk is being written into its
    # blocks, how long that write may take to end before the connection is cut.
    # The blocks are released only once no write can touch them any more.
    # TCP sender: how long a send cancelled part-way may take to reach its next
    # segment boundary (and stop reading the cache) before the connection is cut.
    drain_grace_s: float = 2.0
    # UCX: the sender writes this fraction of each message's bytes itself (a
    # UCX put straight into the receiver's blocks) while the receiver pulls the
    # rest, so the single copy runs on both processes' cores at once; 0 leaves
    # all of it to the receiver. Messages under ucx_put_min_bytes are pulled
    # whole (the put needs a grant from the receiver: one round trip).
    ucx_put_share: float = 0.5
    ucx_put_min_bytes: int = 4 << 20
    # Sender: put a checksum of each run of blocks in the chunk's header (kvtransfer/checksum.py);
    # the receiver checks every run that comes with one and fails the transfer on a mismatch.
    checksum: bool = True

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("connect_timeout_s", "op_timeout_s", "drain_grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.ucx_put_share <= 1:
            raise ValueError(f"ucx_put_share must be in [0, 1], got {self.ucx_put_share}")
        if self.ucx_put_min_bytes < 1:
            raise ValueError(f"ucx_put_min_bytes must be >= 1, got {self.ucx_put_min_bytes}")
        if self.transport != "loopback" and not self.host:
            raise ValueError("host must not be empty")
