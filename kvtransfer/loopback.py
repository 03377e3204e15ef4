"""In-process transport: both ends in one process and one event loop.

For tests of the protocol without sockets, and for single-process mode where
prefill and decode share a process but keep separate KV caches. Headers go
through a JSON round trip, exactly as over a wire, so nothing passes that a
real transport would not carry. A payload is moved by one ``Tensor.copy_``
from the sender's cache view into the receiver's, at the moment the receiver
asks for it; the sender's ``send`` waits until then.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Sequence

import torch

from kvtransfer.errors import TransferError
from kvtransfer.protocol import payload_sizes
from kvtransfer.transport import Connection, Listener, OnConnection, Transport, check_payload

_listeners: dict[str, OnConnection] = {}
_names = itertools.count(1)
_CLOSED = object()


class _Message:
    __slots__ = ("delivered", "header", "payload", "withdrawn")

    def __init__(self, header: dict, payload: list[torch.Tensor], delivered: asyncio.Future):
        self.header = header
        self.payload = payload
        self.delivered = delivered
        self.withdrawn = False  # the sender gave up: its buffers must not be read any more


class LoopbackConnection(Connection):
    def __init__(self, peer: str):
        self.peer = peer
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._other: LoopbackConnection | None = None
        self._pending: _Message | None = None
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    async def send(self, header: dict, payload: Sequence[torch.Tensor] = ()) -> None:
        other = self._other
        if self._closed or other is None or other._closed:
            raise TransferError(f"loopback connection to {self.peer} is closed")
        wire = json.loads(json.dumps({**header, "_payload": [int(t.numel()) for t in payload]}))
        msg = _Message(wire, list(payload), asyncio.get_running_loop().create_future())
        other._inbox.put_nowait(msg)
        if not payload:
            return
        try:
            await msg.delivered
        except asyncio.CancelledError:
            msg.withdrawn = True
            self.close()
            raise

    async def recv(self) -> dict:
        if self._pending is not None:
            raise RuntimeError("recv_payload must consume the previous message's payload first")
        if self._closed:
            raise TransferError(f"loopback connection to {self.peer} is closed")
        item = await self._inbox.get()
        if item is _CLOSED:
            self._closed = True
            raise TransferError(f"loopback peer {self.peer} closed the connection")
        if item.payload:
            self._pending = item
        return item.header

    async def recv_payload(self, header: dict, dests: Sequence[torch.Tensor | None]) -> None:
        msg, self._pending = self._pending, None
        if msg is None or msg.header is not header:
            raise RuntimeError("recv_payload called for a message that is not the pending one")
        sizes = payload_sizes(header)
        if len(dests) != len(sizes):
            raise TransferError(f"{len(dests)} destinations for {len(sizes)} payload buffers")
        if msg.withdrawn or self._closed:
            raise TransferError(f"loopback peer {self.peer} abandoned the message")
        for dest, size, src in zip(dests, sizes, msg.payload):
            check_payload(dest, size)
            if dest is not None:
                dest.copy_(src)
        if not msg.delivered.done():
            msg.delivered.set_result(None)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for msg in self._drain():
            if not msg.delivered.done():
                msg.delivered.set_exception(TransferError(f"loopback peer {self.peer} closed the connection"))
        if self._other is not None and not self._other._closed:
            self._other._inbox.put_nowait(_CLOSED)

    def _drain(self) -> list[_Message]:
        msgs = [self._pending] if self._pending is not None else []
        self._pending = None
        while not self._inbox.empty():
            item = self._inbox.get_nowait()
            if item is not _CLOSED:
                msgs.append(item)
        return msgs


class _LoopbackListener(Listener):
    def __init__(self, address: str, tasks: set[asyncio.Task]):
        self.address = address
        self._tasks = tasks

    async def close(self) -> None:
        _listeners.pop(self.address, None)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class LoopbackTransport(Transport):
    scheme = "loopback"

    async def listen(self, host: str, port: int, on_connection: OnConnection) -> Listener:
        address = f"loopback://{host or 'kv'}-{next(_names)}"
        tasks: set[asyncio.Task] = set()

        async def accept(conn: Connection) -> None:
            task = asyncio.current_task()
            tasks.add(task)
            try:
                await on_connection(conn)
            finally:
                tasks.discard(task)

        _listeners[address] = accept
        return _LoopbackListener(address, tasks)

    async def connect(self, address: str, timeout_s: float) -> Connection:
        accept = _listeners.get(address)
        if accept is None:
            raise TransferError(f"nothing listens at {address}")
        ours, theirs = LoopbackConnection(address), LoopbackConnection("loopback-sender")
        ours._other, theirs._other = theirs, ours
        asyncio.get_running_loop().create_task(accept(theirs))
        return ours
