"""One-sided UCX puts (RMA) on ucxx's own context and endpoints.

ucxx 0.52's Python API has no memory handles, remote keys or puts (its C++
library does, unexported), but it exposes the UCP handles it owns
(``UCXContext.handle``, ``Endpoint.ucp_endpoint``) for interoperability. This
module calls UCP's C API (``ucp.h``) on those handles through ctypes, in the
``libucp`` that ucxx itself loaded, so puts travel on the same endpoints,
with the same error handling and the same progress as every tag message:

    receiver (owner of the memory)            sender
      register(tensor) -> Region                 (once per cache storage)
      region.packed rkey, addresses  ------->    rkey = unpack(ep, packed)
                                                 put(ep, local, n, addr, rkey)
                                                 flush(ep)   (remote completion)
                                    <-------     "done" on any channel

Only whole-storage registrations are made (the KV cache tensor, once), and
the storage object is kept alive with its registration: a registration of
freed memory could otherwise be found again for a new allocation at the
same address. Calls must come from the thread that progresses the worker
(the event loop, ``ucx_progress.EventLoopProgress``).

Request lifetime: an operation that completes at once returns ``None``;
otherwise a ``Request`` whose ``done`` is checked after progress calls and
which is freed exactly once (``release``; UCX frees an unfinished one when
it completes).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import threading

import torch

log = logging.getLogger(__name__)

_c_void_p, _c_size_t, _c_uint64, _c_uint32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_uint32

# ucp.h constants (UCX 1.x API, stable across minor versions)
_MEM_MAP_FIELD_ADDRESS, _MEM_MAP_FIELD_LENGTH, _MEM_MAP_FIELD_PROT = 1 << 0, 1 << 1, 1 << 3
_PROT_LOCAL_READ, _PROT_LOCAL_WRITE, _PROT_REMOTE_READ, _PROT_REMOTE_WRITE = 1 << 0, 1 << 1, 1 << 8, 1 << 9
_UCS_OK, _UCS_INPROGRESS, _UCS_ERR_LAST = 0, 1, -100


class _MemMapParams(ctypes.Structure):  # ucp_mem_map_params_t
    _fields_ = [
        ("field_mask", _c_uint64),
        ("address", _c_void_p),
        ("length", _c_size_t),
        ("flags", ctypes.c_uint),
        ("prot", ctypes.c_uint),
        ("memory_type", ctypes.c_int),
        ("exported_memh_buffer", _c_void_p),
    ]


class _RequestParam(ctypes.Structure):  # ucp_request_param_t; all fields unused (op_attr_mask = 0)
    _fields_ = [
        ("op_attr_mask", _c_uint32),
        ("flags", _c_uint32),
        ("request", _c_void_p),
        ("cb", _c_void_p),
        ("datatype", _c_uint64),
        ("user_data", _c_void_p),
        ("reply_buffer", _c_void_p),
        ("memory_type", ctypes.c_int),
        ("recv_info", _c_void_p),
        ("memh", _c_void_p),
    ]


class RmaError(Exception):
    """A UCP call failed (status code and name in the message)."""


class RmaUnavailable(Exception):
    """libucp could not be found in this process or lacks a needed symbol."""


_lib_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_NO_PARAMS = _RequestParam()


def _libucp() -> ctypes.CDLL:
    """The ``libucp`` ucxx loaded (found in this process's mappings), with signatures."""
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        path = None
        with open("/proc/self/maps") as maps:
            for line in maps:
                name = line.rsplit(None, 1)[-1]
                if "/libucp.so" in name:
                    path = name
                    break
        if path is None:
            raise RmaUnavailable("libucp is not loaded in this process (import ucxx first)")
        try:
            lib = ctypes.CDLL(path)
            lib.ucp_mem_map.argtypes = [_c_void_p, ctypes.POINTER(_MemMapParams), ctypes.POINTER(_c_void_p)]
            lib.ucp_mem_unmap.argtypes = [_c_void_p, _c_void_p]
            lib.ucp_rkey_pack.argtypes = [_c_void_p, _c_void_p, ctypes.POINTER(_c_void_p), ctypes.POINTER(_c_size_t)]
            lib.ucp_rkey_buffer_release.argtypes = [_c_void_p]
            lib.ucp_rkey_buffer_release.restype = None
            lib.ucp_ep_rkey_unpack.argtypes = [_c_void_p, ctypes.c_char_p, ctypes.POINTER(_c_void_p)]
            lib.ucp_rkey_destroy.argtypes = [_c_void_p]
            lib.ucp_rkey_destroy.restype = None
            lib.ucp_put_nbx.argtypes = [_c_void_p, _c_void_p, _c_size_t, _c_uint64, _c_void_p,
                                        ctypes.POINTER(_RequestParam)]
            lib.ucp_put_nbx.restype = _c_void_p
            lib.ucp_ep_flush_nbx.argtypes = [_c_void_p, ctypes.POINTER(_RequestParam)]
            lib.ucp_ep_flush_nbx.restype = _c_void_p
            lib.ucp_request_check_status.argtypes = [_c_void_p]
            lib.ucp_request_check_status.restype = ctypes.c_ssize_t
            lib.ucp_request_free.argtypes = [_c_void_p]
            lib.ucp_request_free.restype = None
            lib.ucs_status_string.argtypes = [ctypes.c_int]
            lib.ucs_status_string.restype = ctypes.c_char_p
        except (OSError, AttributeError) as e:
            raise RmaUnavailable(f"libucp at {path} is not usable for puts: {e}") from None
        _lib = lib
        return lib


def available() -> bool:
    try:
        _libucp()
        return True
    except RmaUnavailable as e:
        log.info("UCX puts unavailable: %s", e)
        return False


def _check(status: int, what: str) -> None:
    if status != _UCS_OK:
        name = _libucp().ucs_status_string(status)
        raise RmaError(f"{what} failed: {name.decode() if name else status}")


class Request:
    """An unfinished UCP operation (put or flush)."""

    __slots__ = ("_ptr", "_status")

    def __init__(self, ptr: int):
        self._ptr: int | None = ptr
        self._status = _UCS_INPROGRESS

    @property
    def done(self) -> bool:
        if self._status == _UCS_INPROGRESS and self._ptr is not None:
            self._status = int(_libucp().ucp_request_check_status(self._ptr))
        return self._status != _UCS_INPROGRESS

    def check(self, what: str) -> None:
        _check(self._status, what)

    def release(self) -> None:
        if self._ptr is not None:
            _libucp().ucp_request_free(self._ptr)
            self._ptr = None


def _request(ptr: int | None, what: str) -> Request | None:
    """``ucs_status_ptr_t`` -> None (done now), a ``Request``, or ``RmaError``."""
    if not ptr:
        return None
    if ptr >= (1 << 64) + _UCS_ERR_LAST:  # UCS_PTR_IS_ERR: a negative status in the pointer
        _check(ptr - (1 << 64), what)
    return Request(ptr)


class Region:
    """A registered host storage and its packed remote key, for peers to put into it."""

    def __init__(self, region_id: int, memh: int, packed: bytes, storage):
        self.id = region_id
        self.memh = memh
        self.packed = packed
        self._storage = storage  # keeps the memory (and so the registration) valid


class Registry:
    """Registrations of this process's UCX context, one per tensor storage, kept for its life."""

    def __init__(self, context_handle: int):
        self._ctx = context_handle
        self._regions: dict[tuple[int, int], Region | None] = {}  # None: UCX refused it
        # Unmapped before ucxx's context is destroyed at interpreter exit (atexit runs
        # before module teardown): UCX otherwise warns, on stdout, of regions in use.
        atexit.register(self.close)

    def close(self) -> None:
        lib = _libucp()
        for region in self._regions.values():
            if region is not None:
                lib.ucp_mem_unmap(self._ctx, region.memh)
        self._regions.clear()

    def region_of(self, t: torch.Tensor) -> Region | None:
        """The registered storage holding ``t`` (registered now if needed); None for device
        memory, or where UCX refused to register it (the caller then moves it otherwise)."""
        if t.device.type != "cpu":
            return None
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in self._regions:
            try:
                self._regions[key] = self._register(len(self._regions), storage)
            except RmaError as e:
                log.warning("cannot register %d bytes for UCX puts, moving them by tag messages: %s", key[1], e)
                self._regions[key] = None
        return self._regions[key]

    def _register(self, region_id: int, storage) -> Region:
        lib = _libucp()
        base, nbytes = storage.data_ptr(), storage.nbytes()
        params = _MemMapParams(
            field_mask=_MEM_MAP_FIELD_ADDRESS | _MEM_MAP_FIELD_LENGTH | _MEM_MAP_FIELD_PROT,
            address=base,
            length=nbytes,
            prot=_PROT_LOCAL_READ | _PROT_LOCAL_WRITE | _PROT_REMOTE_READ | _PROT_REMOTE_WRITE,
        )
        memh = _c_void_p()
        _check(lib.ucp_mem_map(self._ctx, ctypes.byref(params), ctypes.byref(memh)), "ucp_mem_map")
        buf, size = _c_void_p(), _c_size_t()
        try:
            _check(lib.ucp_rkey_pack(self._ctx, memh, ctypes.byref(buf), ctypes.byref(size)), "ucp_rkey_pack")
        except RmaError:
            lib.ucp_mem_unmap(self._ctx, memh)
            raise
        packed = ctypes.string_at(buf, size.value)
        lib.ucp_rkey_buffer_release(buf)
        log.debug("registered %d bytes at %#x for UCX puts", nbytes, base)
        return Region(region_id, memh.value, packed, storage)


class RemoteKeys:
    """A peer's remote keys unpacked on one endpoint (destroyed with the endpoint)."""

    def __init__(self, ep_handle: int):
        self._ep = ep_handle
        self._keys: dict[int, int] = {}

    def add(self, region_id: int, packed: bytes) -> None:
        if region_id in self._keys:
            return
        rkey = _c_void_p()
        _check(_libucp().ucp_ep_rkey_unpack(self._ep, packed, ctypes.byref(rkey)), "ucp_ep_rkey_unpack")
        self._keys[region_id] = rkey.value

    def put(self, src: torch.Tensor, region_id: int, remote_addr: int) -> Request | None:
        """Start writing the contiguous host tensor ``src`` to ``remote_addr`` of the peer's region."""
        rkey = self._keys.get(region_id)
        if rkey is None:
            raise RmaError(f"no remote key for region {region_id}")
        nbytes = src.numel() * src.element_size()
        ptr = _libucp().ucp_put_nbx(self._ep, src.data_ptr(), nbytes, remote_addr, rkey, ctypes.byref(_NO_PARAMS))
        return _request(ptr, "ucp_put_nbx")

    def flush(self) -> Request | None:
        """Start a flush: once done, every put before it is complete at the peer."""
        return _request(_libucp().ucp_ep_flush_nbx(self._ep, ctypes.byref(_NO_PARAMS)), "ucp_ep_flush_nbx")

    def destroy(self) -> None:
        """Before the endpoint is closed: rkeys belong to it."""
        lib = _libucp()
        for rkey in self._keys.values():
            lib.ucp_rkey_destroy(rkey)
        self._keys.clear()
