"""The sender's share of a UCX message: written by put, straight into the receiver's blocks.

A message's payload is cut once (``put_sizes``): the receiver pulls the bytes
before the cut (tag messages, rendezvous read), the sender puts the bytes
after it, both at once, so the single copy runs on two processes' cores::

    sender                                      receiver
      header {_payload, _tags, _put, _ptags} -->  posts receives for the pulled parts
      tag sends of the pulled parts          -->  (pulls them: cma process_vm_readv)
                                             <--  grant {to: [region, address] | null,
                                                         rkeys (first use), until}
      puts of the rest + flush, before until -->  (written by the sender: process_vm_writev)
      put_done                               -->  recv_payload returns

Where the receiver cannot take a put (device memory, a discarded payload) its
grant says null and the sender sends that part as one more tag message
(``_ptags``). Ownership: the receiver grants only inside ``recv_payload``,
i.e. for blocks it is receiving into right now; a put starts only before the
grant's ``until`` (half the receiver's drain grace after the grant, on the
receiver's clock where both share one); a failed transfer's blocks are
released only after that drain grace. cma cannot revoke access once granted,
so what remains is a sender stalled for longer than that inside one copy of
at most one message's tail (milliseconds of work).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtransfer import ucx_rma
from kvtransfer.errors import TransferError


@dataclass(frozen=True)
class PutPolicy:
    share: float = 0.5  # fraction of a message's bytes the sender puts; 0 disables puts
    min_bytes: int = 4 << 20  # smaller messages are pulled whole (a grant costs a round trip)
    grant_valid_s: float = 1.0  # receiver: how long after a grant its puts may start


@dataclass
class UcxTraffic:
    """Payload bytes a transport sent, and how many of them it wrote by put."""

    sent_bytes: int = 0
    put_bytes: int = 0


def put_sizes(sizes: Sequence[int], share: float) -> list[int]:
    """Bytes at the end of each buffer that the sender puts; the rest the receiver pulls.

    The message's bytes are cut once, at ``total - int(share * total)``::

        buffers   [----a----][--b--][------c------]
        cut                      ^
        pulled    [----a----][-]                      a whole, b's head
        put                     [-][------c------]    b's tail, c whole
    """
    total = sum(sizes)
    cut, start, puts = total - int(total * share), 0, []
    for n in sizes:
        puts.append(n - min(n, max(0, cut - start)))
        start += n
    return puts


class Puts:
    """One connection's side of the scheme: what we may put into, and what we let the peer put into."""

    def __init__(self, policy: PutPolicy, registry: ucx_rma.Registry | None, ep_handle: int,
                 peer_takes_puts: bool, same_clock: bool, traffic: UcxTraffic):
        self._policy = policy
        self._registry = registry  # ours: None where puts cannot be used in this process
        self._rkeys = ucx_rma.RemoteKeys(ep_handle) if registry is not None and peer_takes_puts else None
        self._regions_sent: set[int] = set()
        self._same_clock = same_clock  # the peer reads our CLOCK_MONOTONIC: grants' deadlines compare
        self.traffic = traffic

    def sizes(self, payload: Sequence[torch.Tensor], sizes: list[int]) -> list[int]:
        """Sender: bytes of each buffer to put (all zero: pull the message whole)."""
        if self._rkeys is None or sum(sizes) < self._policy.min_bytes or any(t.device.type != "cpu" for t in payload):
            return [0] * len(sizes)  # device memory: UCX's cuda transports move it whole
        return put_sizes(sizes, self._policy.share)

    def grant(self, xid: int, dests, bufs, sizes, puts, ptags, recv: Callable) -> tuple[dict, list, bool]:
        """Receiver: the grant for message ``xid``, the receives posted (through ``recv(buf, tag)``)
        for parts it cannot take by put, and whether any put was granted."""
        to, rkeys, requests = [], {}, []
        for dest, buf, size, put, ptag in zip(dests, bufs, sizes, puts, ptags):
            region = None
            if put and dest is not None and self._registry is not None:
                region = self._registry.region_of(dest)
            if put and region is None:
                requests.append(recv(buf[size - put :], ptag))
            if region is None:
                to.append(None)
                continue
            to.append([region.id, dest.data_ptr() + size - put])
            if region.id not in self._regions_sent:
                rkeys[str(region.id)] = region.packed.hex()
                self._regions_sent.add(region.id)
        valid_s = self._policy.grant_valid_s
        grant = {"xid": xid, "to": to, "rkeys": rkeys, "valid_s": valid_s, "until": time.monotonic() + valid_s}
        return grant, requests, any(w is not None for w in to)

    def write(self, payload, sizes, puts, ptags, grant: dict, send: Callable) -> tuple[list, list]:
        """Sender: start the puts the grant allows (and a flush after them), and the tag sends
        (through ``send(buf, tag)``) of the parts it refused; returns (puts + flush, sends)."""
        if self._same_clock:
            deadline = float(grant.get("until", 0))
        else:  # another host: from receipt (a sender stalled before reading the grant is not caught)
            deadline = time.monotonic() + float(grant.get("valid_s", 0))
        for region_id, packed in grant.get("rkeys", {}).items():
            self._rkeys.add(int(region_id), bytes.fromhex(packed))
        to = grant.get("to", [])
        if len(to) != len(payload):
            raise TransferError("malformed put grant")
        rma, sends = [], []
        try:
            for t, n, p, ptag, where in zip(payload, sizes, puts, ptags, to):
                if not p:
                    continue
                if where is None:
                    sends.append(send(t[n - p :], ptag))
                    continue
                if time.monotonic() > deadline:
                    raise TransferError("put grant expired before the write started")
                rma.append(self._rkeys.put(t[n - p :], int(where[0]), int(where[1])))
                self.traffic.put_bytes += p
            if rma:
                rma.append(self._rkeys.flush())  # once done, every put is complete at the receiver
        except BaseException:
            release(rma)
            raise
        return rma, sends

    def close(self) -> None:
        if self._rkeys is not None:
            self._rkeys.destroy()


def release(requests: Sequence[ucx_rma.Request | None]) -> None:
    for r in requests:
        if r is not None:
            r.release()
