"""Advertised addresses: a worker listening on every interface names a reachable address in the
registry and in its KV-transfer descriptors, never 0.0.0.0."""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch

from kvtransfer import Receiver, Sender, TransferConfig
from services.advertise import advertised_host, host_port
from services.engine.kv_cache import allocate_kv_cache
from tests.kvtransfer.test_kvtransfer_loopback import SPEC, Pool


def test_configured_beats_the_listen_host_and_wildcards_are_refused():
    assert advertised_host("0.0.0.0", "10.1.2.3") == "10.1.2.3"
    assert advertised_host("127.0.0.1") == "127.0.0.1"
    with pytest.raises(ValueError, match="wildcard"):
        advertised_host("0.0.0.0", "0.0.0.0")
    assert host_port("::1", 80) == "[::1]:80" and host_port("10.0.0.1", 80) == "10.0.0.1:80"


def test_a_wildcard_listener_advertises_this_hosts_own_address(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "pod-a")
    monkeypatch.setattr(socket, "getaddrinfo", lambda name, *a, **k: [(0, 0, 0, "", ("127.0.1.1", 0)),
                                                                      (0, 0, 0, "", ("172.18.0.5", 0))])
    assert advertised_host("0.0.0.0") == "172.18.0.5"  # the loopback alias Debian puts in /etc/hosts is skipped
    monkeypatch.setattr(socket, "getaddrinfo", lambda name, *a, **k: [(0, 0, 0, "", ("127.0.1.1", 0))])
    with pytest.raises(ValueError, match="--advertise-host"):
        advertised_host("0.0.0.0")


def test_a_receiver_on_a_wildcard_names_its_advertised_address_and_a_sender_reaches_it():
    async def go():
        cfg = TransferConfig(transport="tcp", host="0.0.0.0", advertise_host="127.0.0.1", op_timeout_s=10)
        src, dst = allocate_kv_cache(SPEC, 16), allocate_kv_cache(SPEC, 16)
        src.copy_(torch.randn(src.shape))
        rx = Receiver(dst, "m", Pool(), cfg)
        address = await rx.start()
        tx = Sender(src, "m", TransferConfig(transport="tcp", op_timeout_s=10))
        try:
            assert address.startswith("tcp://127.0.0.1:") and rx.address == address
            pending = rx.reserve("r", 2, timeout_s=10)
            assert pending.descriptor.address == address  # what the prefill side connects to
            await tx.finish(pending.descriptor, first_token=1, blocks=[3, 4], dst_offset=0)
            done = await pending
            assert torch.equal(dst[list(done.block_ids)], src[[3, 4]])
        finally:
            await tx.close()
            await rx.close()

    asyncio.run(go())
