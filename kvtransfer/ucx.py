"""UCX transport through ``ucxx`` (PyPI ``ucxx-cu12``; runs without a GPU).

Headers travel over a small TCP control connection; payloads, the KV bytes,
travel over UCX straight from the sender's cache into the receiver's reserved
blocks, in a single copy split between the two processes::

    sender                                        receiver
      tcp  header {runs, _payload, _tags, _put} -->  posts a tag receive per run head,
      ucx  tag send per run head                -->  straight into its blocks, and pulls
                                                     it (cma: process_vm_readv)
                                                <--  tcp  grant: where the tails go
      ucx  put of the tails, then a flush       -->  written by the sender
           (cma: process_vm_writev)                  (the receiver does nothing)
      tcp  put_done                             -->  recv_payload returns

By default the sender puts half of a message's bytes (``TransferConfig.
ucx_put_share``) and the receiver pulls the other half at the same time, so
the copy runs on both processes' cores; messages under 4 MiB are pulled whole
(the grant costs a round trip). The put scheme, its grants and the ownership
rule that fences them are in ``ucx_puts.py``; the UCP calls behind the puts
(ucxx 0.52 exposes none in Python) in ``ucx_rma.py``.

Why this shape (measured on the project's 2-core CPU machine, 8k-token
prompt, 189 MB; details in BENCHMARKS.md): with error handling on, UCX moved
every large message through its shared-memory FIFO, copied twice in 8 KiB
pieces, so pdserve reached 3.9 GB/s and a raw ucxx send 4.4 GB/s, while the
kernel copies one process's memory into another's at 4-5 GB/s per core
(process_vm_readv, 512 KiB pieces; memcpy 4-11 GB/s depending on the cache).
One copy instead of two, split across both processes, and waits that do not
spin (``ucx_progress.py``) give 5-7 GB/s with both cores free, 2.8-3.5x TCP
(2.1-2.5x with another job on one of the two cores).

Why not headers over UCX too: headers need a receive kept posted per
connection; the TCP control connection costs nothing while idle and tells at
once when a peer dies, even mid-payload, which UCX alone learns only through
its keepalive.

Connection set-up over the control connection: each side sends its UCX worker
address, a 32-bit *salt*, whether it takes puts and its clock id (kernel boot
id: grants' deadlines compare only between processes on one kernel), opens a
UCX endpoint (with error handling) to the other's worker, and tags every
payload it sends as ``salt << 32 | counter`` with the *peer's* salt. Each
process picks salts unique among its own connections, so tags never collide
in its worker.

Settings, applied to the environment before ``ucxx`` is first imported (UCX
reads them when its context is created) and only where the operator set
nothing (``setdefault``):

- ``UCX_MM_ERROR_HANDLING=y``: endpoints are created with error handling (a
  dead peer must fail its transfers, not hang them); without this UCX refuses
  its shared-memory transports for such endpoints and moves same-host traffic
  over TCP loopback.
- ``UCX_CMA_MEMORY_INVALIDATE=y``: with error handling on, UCX uses a
  zero-copy lane (rendezvous read, put) only if its memory domain can revoke
  a registration, so a failed peer can be cut off. cma (cross-memory attach)
  cannot, and says so by default; UCX then fell back to the two-copy FIFO
  ("rendezvous fragmented copy-in copy-out" in ``UCX_PROTO_INFO=y``) and its
  puts to a software emulation over it. Declaring the capability lets both go
  through cma, one copy. pdserve never relies on UCX revoking access: a pull
  writes only into the puller's own memory, puts are fenced by grants
  (``ucx_puts.py``), and a sender's blocks read after its send was aborted
  feed only a transfer that has failed. Where cma is not allowed (ptrace
  restricted, another PID namespace) UCX goes back to the FIFO by itself.
- ``UCXPY_PROGRESS_MODE=blocking``: progress UCX from the event loop when the
  worker's file descriptor fires, and wait for requests there instead of
  polling them (``ucx_progress.EventLoopProgress``; ucxx's own blocking mode
  busy-polls). ucxx's default, a progress thread, fights the event loop for
  the GIL and gave under 2 GB/s on 2 cores. Puts are made only in this mode
  (they must be issued from the thread that progresses the worker).
- ``UCX_MM_FIFO_SIZE=4096`` (default 64): what still goes through the FIFO
  (eager messages; everything where cma is not allowed) does not stall the
  sender on a full FIFO, which on a busy 2-core machine cost about a
  millisecond per wake-up.
- ``UCX_WARN_UNUSED_ENV_VARS=n``: ucxx sets ``UCX_MEMTYPE_CACHE``, which this
  UCX no longer reads, and UCX would warn about it in every process.

CUDA tensors are passed to ucxx as they are (``__cuda_array_interface__``)
and pulled whole, never put (UCX moves them with cuda_copy / cuda_ipc where
its build has CUDA support, as the ucxx-cu12 wheels do); a receiver whose
blocks are in device memory answers a grant with "send it", and the sender
sends those bytes as tag messages too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
from collections.abc import Sequence

import torch

from kvtransfer import ucx_rma
from kvtransfer.errors import TransferError
from kvtransfer.protocol import payload_sizes
from kvtransfer.tcp import TcpConnection, TcpTransport
from kvtransfer.transport import Connection, Listener, OnConnection, Transport, check_payload, split_address
from kvtransfer.ucx_progress import EventLoopProgress, ensure_progress, progress_driver
from kvtransfer.ucx_puts import PutPolicy, Puts, UcxTraffic, release

log = logging.getLogger(__name__)

UCX_DEFAULT_ENV = {
    "UCX_MM_ERROR_HANDLING": "y",
    "UCX_CMA_MEMORY_INVALIDATE": "y",
    "UCXPY_PROGRESS_MODE": "blocking",
    "UCX_MM_FIFO_SIZE": "4096",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}
# Transport-level messages on the control connection; the protocol never sees them.
_SETUP, _GRANT, _PUT_DONE = "_ucx", "_ucx_grant", "_ucx_put_done"
_salts_in_use: set[int] = set()
_registry: ucx_rma.Registry | None = None


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


def _clock_id() -> str | None:
    """Processes that read the same id share one CLOCK_MONOTONIC (one running kernel)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


_CLOCK_ID = _clock_id()


def _rma_registry(ucxx) -> ucx_rma.Registry | None:
    """This process's registrations for puts, or None where puts cannot be used here."""
    global _registry
    # Puts are issued from the thread that progresses the worker: in pdserve's own
    # progress mode that is the event loop's.
    if _registry is None and isinstance(progress_driver(), EventLoopProgress) and ucx_rma.available():
        _registry = ucx_rma.Registry(ucxx.core._get_ctx().context.handle)
    return _registry


class UcxConnection(Connection):
    def __init__(self, ucxx, ctrl: TcpConnection, endpoint, peer_salt: int, own_salt: int, peer: str, puts: Puts):
        self.peer = peer
        self._ucxx = ucxx
        self._ctrl = ctrl
        self._ep = endpoint
        self._ucx_ep = endpoint._ep  # ucxx's request-level endpoint: requests we wait for ourselves
        self._peer_salt = peer_salt  # tags of what we send
        self._own_salt = own_salt  # tags of what we receive
        self._next = 0
        self._closed = False
        self._peer_closed = False  # the control connection ended (or failed) from the peer's side
        self._puts = puts
        self._waiting: dict[tuple[str, int], asyncio.Future] = {}  # (grant | put_done, message id)
        # Headers are read ahead, so a closed control connection is seen at once,
        # even while a payload is landing, and cuts UCX off too.
        self._headers: asyncio.Queue = asyncio.Queue()
        self._reader = asyncio.get_running_loop().create_task(self._read_headers())

    @property
    def closed(self) -> bool:
        return self._closed

    async def send(self, header: dict, payload: Sequence[torch.Tensor] = ()) -> None:
        self._check_open()
        sizes = [int(t.numel()) for t in payload]
        puts = self._puts.sizes(payload, sizes)
        tags = self._tags(len(payload))
        frame = {**header, "_payload": sizes, "_tags": tags}
        requests = [self._send(t[: n - p], tag) for t, n, p, tag in zip(payload, sizes, puts, tags) if n > p]
        if not any(puts):
            await self._guard(asyncio.gather(self._ctrl.send_header(frame), self._complete(requests)))
        else:
            frame["_put"], frame["_ptags"] = puts, self._tags(len(payload))
            await self._send_with_puts(frame, payload, requests)
        self._puts.traffic.sent_bytes += sum(sizes)

    async def _send_with_puts(self, frame: dict, payload: Sequence[torch.Tensor], requests: list) -> None:
        """The pulled parts are posted; put the rest where the receiver's grant says."""
        xid = frame["_tags"][0]
        grant = self._expect(_GRANT, xid)
        try:
            await self._guard(self._ctrl.send_header(frame))
            granted = await self._guard(grant)
            try:
                rma, sends = self._puts.write(payload, frame["_payload"], frame["_put"], frame["_ptags"], granted,
                                              self._send)
            except (TransferError, ucx_rma.RmaError) as e:
                self.close()  # our tag sends may be half done: the message cannot be finished
                raise TransferError(f"UCX put to {self.peer} failed: {e}") from None
            try:
                await self._guard(self._complete(sends, rma))
            finally:
                release(rma)
            if rma:
                await self._guard(self._ctrl.send_header({"type": _PUT_DONE, "xid": xid}))
            await self._guard(self._complete(requests))
        finally:
            self._waiting.pop((_GRANT, xid), None)

    async def recv(self) -> dict:
        # Headers that arrived before the peer closed are still delivered, as TCP
        # would (a sender's last abort must not be lost to its close); after a close
        # of ours, nothing is.
        if self._closed and not self._peer_closed:
            self._check_open()
        item = await self._headers.get()
        if isinstance(item, TransferError):
            self._headers.put_nowait(item)  # and every later recv fails the same way
            raise item
        return item

    async def recv_payload(self, header: dict, dests: Sequence[torch.Tensor | None]) -> None:
        self._check_open()
        sizes, tags = payload_sizes(header), header.get("_tags", [])
        puts, ptags = header.get("_put", [0] * len(sizes)), header.get("_ptags", [])
        if not len(dests) == len(sizes) == len(tags) == len(puts) or (any(puts) and len(ptags) != len(sizes)):
            raise TransferError(f"{len(dests)} destinations for {len(sizes)} payload buffers")
        for dest, size, put, tag in zip(dests, sizes, puts, tags):
            check_payload(dest, size)
            if tag >> 32 != self._own_salt or not 0 <= put <= size:
                raise TransferError(f"malformed payload framing from {self.peer} (tag {tag:#x})")
        # A discarded buffer still has to be matched, or the sender's send never ends.
        bufs = [torch.empty(size, dtype=torch.uint8) if dest is None else dest for dest, size in zip(dests, sizes)]
        requests = [self._recv(buf[: n - p], tag) for buf, n, p, tag in zip(bufs, sizes, puts, tags) if n > p]
        if not any(puts):
            await self._guard(self._complete(requests))
            return
        grant, more, granted = self._puts.grant(tags[0], dests, bufs, sizes, puts, ptags, self._recv)
        put_done = self._expect(_PUT_DONE, tags[0]) if granted else None
        try:
            await self._guard(self._ctrl.send_header({"type": _GRANT, **grant}))
            await self._guard(self._complete(requests + more))
            if put_done is not None:
                await self._guard(put_done)  # the sender's puts are complete in our memory
        finally:
            self._waiting.pop((_PUT_DONE, tags[0]), None)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._ctrl.close()
        self._reader.cancel()
        error = TransferError(f"UCX connection to {self.peer} is closed")
        self._headers.put_nowait(error)
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(error)
        _salts_in_use.discard(self._own_salt)
        # abort() cancels every request still posted on the endpoint (puts included)
        # before it returns, so no buffer is touched afterwards.
        try:
            self._ep.abort()
        except Exception as e:  # noqa: BLE001 - already broken endpoints complain; closing anyway
            log.debug("closing UCX endpoint to %s: %s", self.peer, e)
        self._puts.close()
        with contextlib.suppress(RuntimeError):  # no running loop: nobody is waiting
            progress_driver().settle()  # wake the waiters of the requests abort() cancelled

    # -- plumbing --------------------------------------------------------------

    def _send(self, t: torch.Tensor, tag: int):
        return self._post(self._ucx_ep.tag_send, t, tag)

    def _recv(self, t: torch.Tensor, tag: int):
        return self._post(self._ucx_ep.tag_recv, t, tag)

    def _post(self, post, t: torch.Tensor, tag: int):
        """A tag request, posted now (it completes inside progress calls: see ``_complete``)."""
        try:
            return post(_array(t), _tag(tag))
        except self._ucxx.exceptions.UCXError as e:
            self.close()
            raise TransferError(f"UCX connection to {self.peer} failed: {type(e).__name__}: {e}") from None

    def _tags(self, n: int) -> list[int]:
        tags = [(self._peer_salt << 32) | ((self._next + i) & 0xFFFFFFFF) for i in range(n)]
        self._next += n
        return tags

    def _expect(self, kind: str, xid: int) -> asyncio.Future:
        """The future of a control message the peer owes us (failed when the connection closes)."""
        fut = self._waiting[kind, xid] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if nobody awaits
        return fut

    async def _complete(self, requests, rma: Sequence[ucx_rma.Request | None] = ()) -> None:
        """Wait for ucxx requests (and UCP puts) without polling them, then raise their errors."""
        rma = [r for r in rma if r is not None]
        progress = progress_driver()
        progress.kick()  # a receive matching a rendezvous already here only moves when progressed
        await progress.wait(lambda: all(r.completed for r in requests) and all(r.done for r in rma))
        for r in requests:
            r.check_error()
        try:
            for r in rma:
                r.check("UCX put")
        except ucx_rma.RmaError as e:
            raise TransferError(f"UCX connection to {self.peer} failed: {e}") from None

    async def _read_headers(self) -> None:
        try:
            while True:
                frame = await self._ctrl.recv()
                kind = frame.get("type")
                if kind not in (_GRANT, _PUT_DONE):
                    self._headers.put_nowait(frame)
                    continue
                fut = self._waiting.get((kind, frame.get("xid")))
                if fut is None or fut.done():
                    raise TransferError(f"unexpected {kind} from {self.peer}")
                fut.set_result(frame)
        except TransferError as e:
            self._peer_closed = True
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


def _array(t: torch.Tensor):
    from ucxx._lib.arr import Array

    return Array(ucx_buffer(t))


def _tag(value: int):
    from ucxx.types import Tag

    return Tag(value)


async def _set_up(ucxx, ctrl: TcpConnection, timeout_s: float, policy: PutPolicy,
                  traffic: UcxTraffic) -> UcxConnection:
    """Exchange worker addresses, salts and put support over ``ctrl``; both ends run the same steps."""
    own_salt = _new_salt()
    try:
        registry = _rma_registry(ucxx)
        address = bytes(ucxx.get_worker_address()).hex()
        await ctrl.send_header(
            {"type": _SETUP, "worker": address, "salt": own_salt, "puts": registry is not None, "clock": _CLOCK_ID}
        )
        reply = await asyncio.wait_for(ctrl.recv(), timeout_s)
        if reply.get("type") != _SETUP:
            raise TransferError(f"{ctrl.peer} is not a pdserve UCX peer (got {reply.get('type')!r})")
        remote = ucxx.get_ucx_address_from_buffer(bytes.fromhex(reply["worker"]))
        ep = await asyncio.wait_for(
            ucxx.create_endpoint_from_worker_address(remote, endpoint_error_handling=True), timeout_s
        )
        same_clock = _CLOCK_ID is not None and reply.get("clock") == _CLOCK_ID
        puts = Puts(policy, registry, ep.ucp_endpoint, bool(reply.get("puts")), same_clock, traffic)
        peer = ctrl.peer.replace("tcp://", "ucx://")
        return UcxConnection(ucxx, ctrl, ep, int(reply["salt"]), own_salt, peer, puts)
    except BaseException as e:
        _salts_in_use.discard(own_salt)
        ctrl.close()
        if isinstance(e, asyncio.TimeoutError):
            raise TransferError(f"UCX set-up with {ctrl.peer} timed out after {timeout_s:g}s") from None
        if isinstance(e, ucxx.exceptions.UCXError | ucx_rma.RmaError | KeyError | ValueError):
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

    def __init__(self, setup_timeout_s: float = 10.0, policy: PutPolicy | None = None):
        # UCX itself starts at the first listen/connect, in the event loop that will
        # progress it; failures there are TransferErrors.
        self._ucxx = import_ucxx()
        self._tcp = TcpTransport()
        self._setup_timeout_s = setup_timeout_s
        self._policy = policy or PutPolicy()
        self.traffic = UcxTraffic()

    async def listen(self, host: str, port: int, on_connection: OnConnection) -> Listener:
        ucxx = self._ucxx
        ensure_progress(ucxx)

        async def accept(ctrl: Connection) -> None:
            with contextlib.suppress(TransferError):  # a failed set-up only affects that peer
                conn = await _set_up(ucxx, ctrl, self._setup_timeout_s, self._policy, self.traffic)
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
        return await _set_up(self._ucxx, ctrl, timeout_s, self._policy, self.traffic)
