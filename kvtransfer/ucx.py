"""UCX transport through ``ucxx`` (PyPI ``ucxx-cu12``; runs without a GPU).

Headers travel over a small TCP control connection; payloads, the KV bytes,
travel over UCX::

    sender                                       receiver
      tcp  header {runs, _payload, _tags}  --->    reads the header, posts one UCX
      ucx  tagged send per run (cache mem) --->    tagged receive per run, straight
                                                   into the reserved blocks

Why not headers over UCX too: in ucxx's non-thread progress modes an awaited
request is polled (``await asyncio.sleep(0)`` until done), so a receive kept
posted for the next header costs a full core per connection, idle or not.
With headers on TCP, UCX has requests in flight only while KV moves; idle
connections cost nothing (see also ``ucx_progress.py``). The control
connection also tells at once when a peer dies, even mid-payload, which UCX
alone learns only through its keepalive.

Connection set-up over the control connection: each side sends its UCX worker
address and a 32-bit *salt*, opens a UCX endpoint (with error handling) to the
other's worker, and tags every payload it sends as ``salt << 32 | counter``
with the *peer's* salt. Each process picks salts unique among its own
connections, so tags never collide in its worker. Payloads above UCX's
rendezvous threshold are pulled by the receiver from the sender's memory, so
one that arrives before its receive is posted waits without being copied.

Settings, applied to the environment before ``ucxx`` is first imported (UCX
reads them when its context is created) and only where the operator set
nothing (``setdefault``):

- ``UCX_MM_ERROR_HANDLING=y``: endpoints are created with error handling (a
  dead peer must fail its transfers, not hang them); without this UCX refuses
  its shared-memory transports for such endpoints and moves same-host traffic
  over TCP loopback.
- ``UCXPY_PROGRESS_MODE=blocking``: progress UCX from the event loop when the
  worker's file descriptor fires (``ucx_progress.EventLoopProgress``; ucxx's
  own blocking progress busy-polls). ucxx's default, a progress thread, fights
  the event loop for the GIL and gave under 2 GB/s on 2 cores.
- ``UCX_MM_FIFO_SIZE=4096`` (default 64): with error handling on, large
  messages between processes on one host go through the shared-memory FIFO in
  8 KiB segments, and the sender sleeps whenever the FIFO is full until the
  receiver drains it. On a busy 2-core machine each such wake-up costs about
  a millisecond: a 189 MB message took 0.7 s (0.26 GB/s) with 64 entries and
  0.17 s (1.1 GB/s) with 4096, same machine, same minute.
- ``UCX_WARN_UNUSED_ENV_VARS=n``: ucxx sets ``UCX_MEMTYPE_CACHE``, which this
  UCX no longer reads, and UCX would warn about it in every process.

CUDA tensors are passed to ucxx as they are (``__cuda_array_interface__``);
UCX moves them with cuda_copy / cuda_ipc where its build has CUDA support
(the ucxx-cu12 wheels do).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
from collections.abc import Sequence

import numpy as np
import torch

from kvtransfer.protocol import payload_sizes
from kvtransfer.tcp import TcpConnection, TcpTransport
from kvtransfer.transport import Connection, Listener, OnConnection, Transport, check_payload, split_address
from kvtransfer.ucx_progress import ensure_progress
from services.errors import TransferError

log = logging.getLogger(__name__)

UCX_DEFAULT_ENV = {
    "UCX_MM_ERROR_HANDLING": "y",
    "UCXPY_PROGRESS_MODE": "blocking",
    "UCX_MM_FIFO_SIZE": "4096",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}
_SETUP = "_ucx"  # transport-level set-up message on the control connection
_salts_in_use: set[int] = set()


class UcxUnavailable(Exception):
    """ucxx cannot be imported or initialised in this process."""


def apply_ucx_env(environ=os.environ) -> None:
    for key, value in UCX_DEFAULT_ENV.items():
        environ.setdefault(key, value)


def import_ucxx():
    """``ucxx``, imported with pdserve's UCX settings in the environment."""
    apply_ucx_env()
    try:
        import ucxx
    except ImportError as e:
        raise UcxUnavailable(f"the UCX KV transport needs the ucxx package ({e})") from None
    except Exception as e:  # noqa: BLE001 - a broken libucx raises all sorts while loading
        raise UcxUnavailable(f"ucxx failed to load: {e}") from None
    ctx = ucxx.core._ctx
    if ctx is not None and ctx.progress_mode != os.environ["UCXPY_PROGRESS_MODE"]:
        log.warning("ucxx was initialised before pdserve in %r progress mode", ctx.progress_mode)
    return ucxx


def ucx_buffer(t: torch.Tensor):
    # ucxx reads host memory through the buffer protocol (a numpy view: no copy)
    # and device memory through __cuda_array_interface__.
    return t.numpy() if t.device.type == "cpu" else t


def _new_salt() -> int:
    while (salt := random.getrandbits(32)) in _salts_in_use:
        pass
    _salts_in_use.add(salt)
    return salt


class UcxConnection(Connection):
    def __init__(self, ucxx, ctrl: TcpConnection, endpoint, peer_salt: int, own_salt: int, peer: str):
        self.peer = peer
        self._ucxx = ucxx
        self._ctrl = ctrl
        self._ep = endpoint
        self._peer_salt = peer_salt  # tags of what we send
        self._own_salt = own_salt  # tags of what we receive
        self._next = 0
        self._closed = False
        # Headers are read ahead, so a closed control connection is seen at once,
        # even while a payload is landing, and cuts UCX off too.
        self._headers: asyncio.Queue = asyncio.Queue()
        self._reader = asyncio.get_running_loop().create_task(self._read_headers())

    @property
    def closed(self) -> bool:
        return self._closed

    async def send(self, header: dict, payload: Sequence[torch.Tensor] = ()) -> None:
        self._check_open()
        tags = [(self._peer_salt << 32) | (self._next + i) for i in range(len(payload))]
        self._next += len(payload)
        frame = {**header, "_payload": [int(t.numel()) for t in payload], "_tags": tags}
        sends = [self._ep.send(ucx_buffer(t), tag=tag, force_tag=True) for t, tag in zip(payload, tags)]
        await self._guard(asyncio.gather(self._ctrl.send_header(frame), *sends))

    async def recv(self) -> dict:
        self._check_open()
        item = await self._headers.get()
        if isinstance(item, TransferError):
            raise item
        return item

    async def recv_payload(self, header: dict, dests: Sequence[torch.Tensor | None]) -> None:
        self._check_open()
        sizes, tags = payload_sizes(header), header.get("_tags", [])
        if not len(dests) == len(sizes) == len(tags):
            raise TransferError(f"{len(dests)} destinations for {len(sizes)} payload buffers")
        recvs = []
        for dest, size, tag in zip(dests, sizes, tags):
            check_payload(dest, size)
            if tag >> 32 != self._own_salt:
                raise TransferError(f"payload tag {tag:#x} from {self.peer} is not ours")
            # A discarded buffer still has to be matched, or the sender's send never ends.
            buf = np.empty(size, dtype=np.uint8) if dest is None else ucx_buffer(dest)
            recvs.append(self._ep.recv(buf, tag=tag, force_tag=True))
        await self._guard(asyncio.gather(*recvs))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._ctrl.close()
        self._reader.cancel()
        self._headers.put_nowait(TransferError(f"UCX connection to {self.peer} is closed"))
        _salts_in_use.discard(self._own_salt)
        # abort() cancels every request still posted on the endpoint before it
        # returns, so no buffer is touched afterwards.
        try:
            self._ep.abort()
        except Exception as e:  # noqa: BLE001 - already broken endpoints complain; closing anyway
            log.debug("closing UCX endpoint to %s: %s", self.peer, e)

    async def _read_headers(self) -> None:
        try:
            while True:
                self._headers.put_nowait(await self._ctrl.recv())
        except TransferError as e:
            self._headers.put_nowait(e)
            self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"UCX connection to {self.peer} is closed")

    async def _guard(self, aw):
        try:
            return await aw
        except asyncio.CancelledError:
            self.close()
            raise
        except TransferError:
            self.close()
            raise
        except self._ucxx.exceptions.UCXError as e:
            self.close()
            raise TransferError(f"UCX connection to {self.peer} failed: {type(e).__name__}: {e}") from None


async def _set_up(ucxx, ctrl: TcpConnection, timeout_s: float) -> UcxConnection:
    """Exchange worker addresses and salts over ``ctrl``; both ends run the same steps."""
    own_salt = _new_salt()
    try:
        address = bytes(ucxx.get_worker_address()).hex()
        await ctrl.send_header({"type": _SETUP, "worker": address, "salt": own_salt})
        reply = await asyncio.wait_for(ctrl.recv(), timeout_s)
        if reply.get("type") != _SETUP:
            raise TransferError(f"{ctrl.peer} is not a pdserve UCX peer (got {reply.get('type')!r})")
        remote = ucxx.get_ucx_address_from_buffer(bytes.fromhex(reply["worker"]))
        ep = await asyncio.wait_for(
            ucxx.create_endpoint_from_worker_address(remote, endpoint_error_handling=True), timeout_s
        )
        return UcxConnection(ucxx, ctrl, ep, int(reply["salt"]), own_salt, ctrl.peer.replace("tcp://", "ucx://"))
    except BaseException as e:
        _salts_in_use.discard(own_salt)
        ctrl.close()
        if isinstance(e, asyncio.TimeoutError):
            raise TransferError(f"UCX set-up with {ctrl.peer} timed out after {timeout_s:g}s") from None
        if isinstance(e, ucxx.exceptions.UCXError | KeyError | ValueError):
            raise TransferError(f"UCX set-up with {ctrl.peer} failed: {type(e).__name__}: {e}") from None
        raise


class _UcxListener(Listener):
    def __init__(self, address: str, control: Listener):
        self.address = address
        self._control = control

    async def close(self) -> None:
        await self._control.close()


class UcxTransport(Transport):
    scheme = "ucx"

    def __init__(self, setup_timeout_s: float = 10.0):
        # UCX itself starts at the first listen/connect, in the event loop that will
        # progress it; failures there are TransferErrors.
        self._ucxx = import_ucxx()
        self._tcp = TcpTransport()
        self._setup_timeout_s = setup_timeout_s

    async def listen(self, host: str, port: int, on_connection: OnConnection) -> Listener:
        ucxx = self._ucxx
        ensure_progress(ucxx)

        async def accept(ctrl: Connection) -> None:
            with contextlib.suppress(TransferError):  # a failed set-up only affects that peer
                conn = await _set_up(ucxx, ctrl, self._setup_timeout_s)
                try:
                    await on_connection(conn)
                finally:
                    conn.close()

        control = await self._tcp.listen(host, port, accept)
        return _UcxListener(control.address.replace("tcp://", "ucx://", 1), control)

    async def connect(self, address: str, timeout_s: float) -> Connection:
        host, port = split_address(address, self.scheme)
        ensure_progress(self._ucxx)
        ctrl = await self._tcp.connect(f"tcp://{host}:{port}", timeout_s)
        return await _set_up(self._ucxx, ctrl, timeout_s)
