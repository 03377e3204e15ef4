"""Plain TCP transport: the fallback where UCX is not installed or not usable.

Wire format, per message: a 4-byte little-endian header length, the JSON
header (with ``_payload``: the byte size of each buffer), then each payload
buffer cut into segments, each a 4-byte little-endian length and that many
bytes (``SEGMENT_BYTES`` at most)::

    [len][header JSON {_payload: [n0, n1]}] [s][n0 bytes in s-byte pieces...] [s][n1 bytes...]
                                                                   or, cancelled:   [ABANDONED]

Why segments: one connection carries every transfer between a sender and a
receiver, so a send cancelled part-way (its request was aborted, its client
left) must not take the others down. Its writer stops reading the caller's
buffers at the next segment boundary and writes the ``ABANDONED`` mark in
place of a length; that message ends there, the reader's ``recv_payload``
raises ``SendAbandoned`` (the receiver fails that one transfer) and the next
message follows in step. Before, a cancel closed the socket and every other
transfer on it failed ("[Errno 9] Bad file descriptor"). A send cancelled
while still queued never writes a byte. Only a writer that cannot reach the
next boundary within ``cancel_grace_s`` (the peer reads nothing) cuts the
connection: then every transfer on it is stuck anyway.

Each connection owns a blocking socket and two daemon threads, one reading
and one writing, so a run of KV blocks moves in a few large ``sendall`` /
``recv_into(MSG_WAITALL)`` calls straight from and into the cache memory,
with the GIL released, instead of many small event-loop reads. Daemon threads
(not a ``ThreadPoolExecutor``, whose threads are joined at exit) so that a
process never hangs on exit behind a blocked read. CUDA payloads are staged
through host memory: TCP cannot read device memory.

The threads do not rely on the socket staying blocking: uvloop's
``add_reader`` (the loop's header reads, below) puts the file descriptor in
non-blocking mode for good, for both directions, and a thread's ``sendall`` or
``recv_into(MSG_WAITALL)`` then fails with EAGAIN whenever the peer is slower
than the socket buffer (CI saw KV hand-offs fail that way under load). So the
threads write and read in their own loops and wait in ``poll`` on EAGAIN.

Headers alone (``recv``, ``send_header``: all that UCX's control connection
carries, and the acks of this transport) skip the threads: the event loop
reads exactly the header's bytes when the socket is readable and writes a
header with a non-blocking send when no payload is being written, so a
control message costs one wake-up of each process rather than three thread
hand-offs (a millisecond or more on a busy machine). Reads and writes of a
connection stay in order: the loop touches the socket only while no thread
job of the same direction is pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import select
import socket
import struct
import threading
from collections.abc import Callable, Sequence

import torch

from kvtransfer.errors import SendAbandoned, TransferError
from kvtransfer.protocol import PREFIX_BYTES, decode_body, encode_header, header_length, payload_sizes
from kvtransfer.transport import Connection, Listener, OnConnection, Transport, check_payload, split_address


# A segment's length, or ABANDONED. 4 MiB: a cancelled send stops within 4 MiB of
# writing, and a GiB costs 256 more small writes and reads than one sendall would.
SEGMENT_BYTES = 4 << 20
ABANDONED = 0xFFFFFFFF
_SEGMENT = struct.Struct("<I")
_ABANDON_MARK = _SEGMENT.pack(ABANDONED)
_MSG_MORE = getattr(socket, "MSG_MORE", 0)  # a segment's length goes out in the same packet as its bytes


class _Outgoing:
    """One message for the writer thread. ``cancelled`` is set by the loop and read by the thread
    between segments (a plain attribute: one store, one load, under the GIL)."""

    __slots__ = ("frame", "views", "cancelled", "begun")

    def __init__(self, frame: bytes, views: list[memoryview], *, begun: bool = False):
        self.frame, self.views = frame, views
        self.cancelled = False
        self.begun = begun  # part of the frame is on the wire already: it must be finished


class _Worker:
    """One daemon thread running blocking calls in order, results as asyncio futures."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def submit(self, fn: Callable, *args) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._jobs.put((loop, fut, fn, args))
        return fut

    def stop(self) -> None:
        self._jobs.put(None)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, fut, fn, args = job
            try:
                result, error = fn(*args), None
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine, never lost
                result, error = None, e
            with contextlib.suppress(RuntimeError):  # loop already closed: nobody is waiting
                loop.call_soon_threadsafe(_settle, fut, result, error)


def _settle(fut: asyncio.Future, result, error) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)


def _wait_for(sock: socket.socket, event: int) -> None:
    """Block until ``sock`` is ready for ``event`` (or hung up, or closed: the retried call then fails)."""
    poller = select.poll()
    poller.register(sock.fileno(), event)
    poller.poll()


def _send_all(sock: socket.socket, data, flags: int = 0) -> None:
    """``sendall`` that also works when the event loop has made the socket non-blocking."""
    view = memoryview(data).cast("B")
    while view:
        try:
            view = view[sock.send(view, flags):]
        except (BlockingIOError, InterruptedError):
            _wait_for(sock, select.POLLOUT)


def _host_view(t: torch.Tensor) -> memoryview:
    return memoryview((t if t.device.type == "cpu" else t.cpu()).numpy())


class TcpConnection(Connection):
    def __init__(self, sock: socket.socket, peer: str, cancel_grace_s: float = 2.0):
        sock.setblocking(True)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.peer = peer
        self._sock = sock
        self._closed = False
        self._why = ""  # why it was closed, for the errors of the calls that find it closed
        self._cancel_grace_s = cancel_grace_s  # see _stop_reading
        self._rx = _Worker(f"kv-tcp-rx-{peer}")
        self._tx = _Worker(f"kv-tcp-tx-{peer}")
        self._tx_pending = 0  # jobs submitted to the writer thread and not yet done
        self._readable: asyncio.Future | None = None  # the loop waits for the socket to be readable

    @property
    def closed(self) -> bool:
        return self._closed

    async def send(self, header: dict, payload: Sequence[torch.Tensor] = ()) -> None:
        frame = encode_header({**header, "_payload": [int(t.numel()) for t in payload]})
        await self._send(_Outgoing(frame, [_host_view(t) for t in payload]))

    async def recv(self) -> dict:
        try:
            prefix = await self._read_on_loop(PREFIX_BYTES)
            return decode_body(await self._read_on_loop(header_length(prefix)))
        except asyncio.CancelledError:
            self.close("a header read was cancelled")  # part of it may have been read: out of step
            raise
        except (OSError, ValueError, EOFError) as e:
            error = self._error(e)
            self.close(str(e))
            raise error from None

    async def send_header(self, header: dict) -> None:
        """Send a header alone, framing keys as given (ucx.py carries its payloads over UCX)."""
        frame = encode_header(header)
        if self._closed:
            raise self._error(EOFError())
        if self._tx_pending == 0:  # nothing queued ahead of it: try to write it from the loop
            try:
                sent = self._sock.send(frame, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as e:
                error = self._error(e)
                self.close(str(e))
                raise error from None
            if sent == len(frame):
                return
            # The socket buffer is full: the thread writes the rest, in order (and, once begun,
            # even if this call is cancelled: half a header would put the stream out of step).
            await self._send(_Outgoing(frame[sent:], [], begun=sent > 0))
            return
        await self._send(_Outgoing(frame, []))

    async def recv_payload(self, header: dict, dests: Sequence[torch.Tensor | None]) -> None:
        sizes = payload_sizes(header)
        if len(dests) != len(sizes):
            raise TransferError(f"{len(dests)} destinations for {len(sizes)} payload buffers")
        for dest, size in zip(dests, sizes):
            check_payload(dest, size)
        staged = [d.cpu() if d is not None and d.device.type != "cpu" else d for d in dests]
        await self._call(self._rx, self._read_payload, sizes, staged)
        for dest, host in zip(dests, staged):
            if dest is not None and host is not dest:
                dest.copy_(host)

    def close(self, why: str = "this side closed it") -> None:
        if self._closed:
            return
        self._closed, self._why = True, why
        if self._readable is not None:  # a read waiting on the loop: stop watching the socket, fail it
            with contextlib.suppress(Exception):
                self._readable.get_loop().remove_reader(self._sock.fileno())
            if not self._readable.done():
                self._readable.set_exception(EOFError("connection closed"))
            self._readable = None
        # shutdown() wakes a thread blocked in recv/send on this socket; close() alone does not.
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._rx.stop()
        self._tx.stop()

    def _error(self, e: BaseException) -> TransferError:
        """The error of a failed call, naming why the connection was closed if it already was
        (jobs queued behind a close would otherwise all say "[Errno 9] Bad file descriptor")."""
        if self._closed:
            return TransferError(f"TCP connection to {self.peer} is closed ({self._why})")
        return TransferError(f"TCP connection to {self.peer} failed: {e}")

    async def _send(self, out: _Outgoing) -> None:
        await self._call(self._tx, self._write, out, outgoing=out)

    async def _call(self, worker: _Worker, fn: Callable, *args, outgoing: _Outgoing | None = None):
        if self._closed:
            raise self._error(EOFError())
        fut = worker.submit(fn, *args)
        if worker is self._tx:
            self._tx_pending += 1
            fut.add_done_callback(self._tx_done)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if outgoing is None:
                # A read cut part-way: the stream is out of step. The thread may still be
                # writing into the buffers: cut the socket so it returns, and wait for it.
                self.close("a payload read was cancelled part-way")
                with contextlib.suppress(BaseException):
                    await fut
                raise
            outgoing.cancelled = True  # the writer skips it, or abandons it at a segment boundary
            if outgoing.views:
                await self._stop_reading(fut)  # the caller may reuse its buffers once we raise
            raise
        except (OSError, ValueError, EOFError) as e:
            error = self._error(e)
            self.close(str(e))
            raise error from None

    async def _stop_reading(self, fut: asyncio.Future) -> None:
        """Wait until the writer no longer reads a cancelled message's buffers: it reaches the next
        segment boundary, unless the peer reads nothing for ``cancel_grace_s``; then cut the
        connection, which wakes the writer at once."""
        try:
            await asyncio.wait({fut}, timeout=self._cancel_grace_s)
        except asyncio.CancelledError:
            pass  # cancelled again while it winds down: stop waiting, cut below
        if not fut.done():
            self.close(f"a send cancelled part-way could not stop within {self._cancel_grace_s:g}s "
                       f"(the peer read nothing)")
            while not fut.done():  # prompt now; the buffers are ours again only after it
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({fut})
        elif fut.exception() is not None:  # the socket failed while it wound down
            self.close(str(fut.exception()))

    def _tx_done(self, _fut) -> None:
        self._tx_pending -= 1

    async def _read_on_loop(self, n: int) -> bytes:
        """Exactly ``n`` bytes, read by the event loop (never more: a payload may follow)."""
        if self._closed:
            raise self._error(EOFError())
        buf, got = bytearray(n), 0
        view = memoryview(buf)
        loop = asyncio.get_running_loop()
        while got < n:
            try:
                k = self._sock.recv_into(view[got:], n - got, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                fd = self._sock.fileno()
                self._readable = fut = loop.create_future()
                loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
                try:
                    await fut
                finally:
                    if self._readable is fut:
                        self._readable = None
                        loop.remove_reader(fd)
                continue
            if k == 0:
                raise EOFError(f"peer closed the connection after {got} of {n} header bytes")
            got += k
        return bytes(buf)

    def _write(self, out: _Outgoing) -> bool:
        """Write one message (writer thread); False if it was cancelled and did not all go out."""
        if out.cancelled and not out.begun:
            return False  # cancelled while queued: not a byte of it went out
        _send_all(self._sock, out.frame)
        for view in out.views:
            for start in range(0, len(view), SEGMENT_BYTES):
                if out.cancelled:
                    _send_all(self._sock, _ABANDON_MARK)
                    return False
                piece = view[start : start + SEGMENT_BYTES]
                _send_all(self._sock, _SEGMENT.pack(len(piece)), _MSG_MORE)
                _send_all(self._sock, piece)
        return True

    def _read_exact(self, view: memoryview) -> None:
        got, total = 0, len(view)
        while got < total:
            try:
                n = self._sock.recv_into(view[got:], total - got, socket.MSG_WAITALL)
            except (BlockingIOError, InterruptedError):  # made non-blocking by the loop: wait here
                _wait_for(self._sock, select.POLLIN)
                continue
            if n == 0:
                raise EOFError(f"peer closed the connection after {got} of {total} bytes")
            got += n

    def _read_payload(self, sizes: list[int], dests: list[torch.Tensor | None]) -> None:
        """Read a message's payload segments into ``dests`` (reader thread); raises SendAbandoned
        where the sender's mark says it gave up on the message (the stream is still in step)."""
        length = memoryview(bytearray(_SEGMENT.size))
        scratch = None
        for i, (size, dest) in enumerate(zip(sizes, dests)):
            view = memoryview(dest.numpy()) if dest is not None else None
            got = 0
            while got < size:
                self._read_exact(length)
                (n,) = _SEGMENT.unpack(length)
                if n == ABANDONED:
                    raise SendAbandoned(f"{self.peer} abandoned the message part-way (buffer {i + 1} of "
                                        f"{len(sizes)}: {got} of {size} bytes): its send was cancelled")
                if not 0 < n <= size - got:
                    raise ValueError(f"malformed payload segment of {n} bytes ({size - got} left of {size})")
                if view is not None:
                    self._read_exact(view[got : got + n])
                else:  # a discarded payload: read it in bounded pieces rather than allocating its size
                    scratch = scratch or memoryview(bytearray(1 << 20))
                    left = n
                    while left:
                        piece = min(left, len(scratch))
                        self._read_exact(scratch[:piece])
                        left -= piece
                got += n


class _TcpListener(Listener):
    def __init__(self, address: str, sock: socket.socket, task: asyncio.Task, conns: set[asyncio.Task]):
        self.address = address
        self._sock = sock
        self._task = task
        self._conns = conns

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._sock.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)


class TcpTransport(Transport):
    scheme = "tcp"

    def __init__(self, cancel_grace_s: float = 2.0):
        # How long a send cancelled part-way may take to reach a segment boundary before its
        # connection is cut (the peer reads nothing); the registry passes drain_grace_s.
        self.cancel_grace_s = cancel_grace_s

    async def listen(self, host: str, port: int, on_connection: OnConnection) -> Listener:
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
        conns: set[asyncio.Task] = set()

        async def serve(conn: Connection) -> None:
            try:
                await on_connection(conn)
            finally:
                conn.close()

        async def accept_loop() -> None:
            while True:
                client, addr = await loop.sock_accept(sock)
                task = loop.create_task(serve(TcpConnection(client, f"tcp://{addr[0]}:{addr[1]}", self.cancel_grace_s)))
                conns.add(task)
                task.add_done_callback(conns.discard)

        task = loop.create_task(accept_loop())
        bound = sock.getsockname()
        return _TcpListener(f"tcp://{host}:{bound[1]}", sock, task, conns)

    async def connect(self, address: str, timeout_s: float) -> Connection:
        host, port = split_address(address, self.scheme)
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, _, _, _, sockaddr = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await asyncio.wait_for(loop.sock_connect(sock, sockaddr), timeout_s)
            except BaseException:
                sock.close()
                raise
        except TimeoutError:
            raise TransferError(f"connecting to {address} timed out after {timeout_s:g}s") from None
        except OSError as e:
            raise TransferError(f"cannot connect to {address}: {e}") from None
        return TcpConnection(sock, address, self.cancel_grace_s)
