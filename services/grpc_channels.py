"""``Channels``: one gRPC channel per worker address, shared by every call (the router's dispatch,
a prefill worker's peer fetches)."""

from __future__ import annotations

import grpc


class Channels:
    """One gRPC channel per worker address, shared by every request."""

    def __init__(self):
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc.aio.insecure_channel(address)
        return ch

    async def aclose(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
