"""When bytes reached a socket, from the kernel: the instrument for latencies a busy reader would inflate.

A benchmark process that reads a thousand sockets in one event loop on the same
two cores as the server notes, for each message, when its loop got around to
reading it: that adds the reader's own waits (for a core, for its loop, for its
garbage collector) to whatever it measures. With ``SO_TIMESTAMPNS`` the kernel
stamps each received packet with the wall clock (``CLOCK_REALTIME``, the clock
``time.time()`` reads) as it is delivered to the socket, and ``recvmsg`` hands
the stamp of the newest packet it returns. So a read that was late still says
when its bytes arrived, and a read that returns several packets says when the
last of them did: never earlier than the bytes it carries.
"""

from __future__ import annotations

import socket
import struct
import time

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux's value where Python does not name it
_STAMP = struct.Struct("qq")  # struct timespec: seconds, nanoseconds
_ANCILLARY = socket.CMSG_SPACE(_STAMP.size)


def enable(sock: socket.socket) -> bool:
    """Ask the kernel to stamp what ``sock`` receives; False where it cannot (then reads are timed by the clock)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    return True


def recv(sock: socket.socket, size: int = 1 << 16) -> tuple[bytes, float]:
    """Up to ``size`` bytes and when the newest of them reached the socket (the wall clock now if unstamped).
    Raises what ``recv`` raises (``BlockingIOError`` on a non-blocking socket with nothing to read)."""
    data, ancillary, _, _ = sock.recvmsg(size, _ANCILLARY)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(payload) >= _STAMP.size:
            seconds, nanoseconds = _STAMP.unpack_from(payload)
            return data, seconds + nanoseconds / 1e9
    return data, time.time()
