"""The transport interface: ordered message channels that carry KV bytes.

A transport moves *messages* (a JSON header plus zero or more payload byte
buffers) between two processes; ``sender.py`` and ``receiver.py`` speak the
block protocol (``protocol.py``) over it and never see sockets or UCX.

Three implementations, chosen by ``TransferConfig.transport`` (``registry.py``
maps the name to one; this module imports none of them, they import it):

- ``ucx`` (``ucx.py``, default): UCX through ``ucxx``; cma and shared memory
  on one host, RDMA or TCP between hosts, CUDA memory where UCX has
  cuda_copy / cuda_ipc. Payloads go from the sender's cache to the
  receiver's cache in one copy, pulled by the receiver and put by the sender
  at once (``ucx_puts.py``).
- ``tcp`` (``tcp.py``): plain sockets, for hosts without UCX. CPU payloads are
  read and written in place; CUDA payloads are staged through host memory.
- ``loopback`` (``loopback.py``): both ends in one process (tests,
  single-process mode); a payload is one ``Tensor.copy_``.

Contract every implementation keeps (the ownership rules of sender/receiver
rest on it):

- ``send`` never interleaves the buffers of two messages, and when it returns
  *or raises* (cancellation included) the payload buffers are no longer read.
- ``recv_payload`` writes only into the given destinations, and when it
  returns or raises nothing will write into them any more.
- Failures raise ``TransferError``; a failed send/recv, or a cancelled recv,
  leaves the connection closed, since a half-moved message cannot be resumed.
  A cancelled send closes it too, unless the transport can end the message
  early in a way the reader understands: TCP's writer abandons it at a segment
  boundary and the reader's ``recv_payload`` raises ``SendAbandoned``
  (``errors.py``), so the other transfers sharing the connection go on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence

import torch

from kvtransfer.errors import TransferError


class Connection(ABC):
    peer: str  # printable remote end, for error messages

    @abstractmethod
    async def send(self, header: dict, payload: Sequence[torch.Tensor] = ()) -> None:
        """Send one message; ``payload`` holds contiguous uint8 tensors (CPU or CUDA)."""

    @abstractmethod
    async def recv(self) -> dict:
        """The next message header. If it announces payload (``protocol.payload_sizes``),
        ``recv_payload`` must be called before the next ``recv``."""

    @abstractmethod
    async def recv_payload(self, header: dict, dests: Sequence[torch.Tensor | None]) -> None:
        """Receive the payload of ``header`` into ``dests`` (one per buffer, of exactly
        the announced size); ``None`` receives and discards that buffer."""

    @abstractmethod
    def close(self) -> None:
        """Drop the connection now; pending and later calls on either end raise."""

    @property
    @abstractmethod
    def closed(self) -> bool: ...


class Listener(ABC):
    address: str  # what a descriptor advertises: "<scheme>://..."

    @abstractmethod
    async def close(self) -> None: ...


OnConnection = Callable[[Connection], Awaitable[None]]


class Transport(ABC):
    scheme: str

    @abstractmethod
    async def listen(self, host: str, port: int, on_connection: OnConnection) -> Listener:
        """Accept connections; ``on_connection`` runs for each one's whole life."""

    @abstractmethod
    async def connect(self, address: str, timeout_s: float) -> Connection: ...


def split_address(address: str, scheme: str) -> tuple[str, int]:
    """``"<scheme>://host:port"`` -> ``(host, port)``; a clear error for anything else."""
    prefix = scheme + "://"
    if not address.startswith(prefix):
        raise TransferError(f"address {address!r} is not a {scheme} address")
    host, sep, port = address[len(prefix) :].rpartition(":")
    if not sep or not host or not port.isdigit():
        raise TransferError(f"address {address!r} is not of the form {prefix}host:port")
    return host.strip("[]"), int(port)


def check_payload(dest: torch.Tensor | None, size: int) -> None:
    if dest is not None and (dest.dtype != torch.uint8 or dest.numel() != size or not dest.is_contiguous()):
        raise TransferError(f"payload of {size} bytes does not fit its destination ({dest.numel()} bytes)")
