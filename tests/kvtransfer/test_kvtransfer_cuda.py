"""KV caches in CUDA memory on both sides, between two processes on one GPU.

UCX moves device memory itself (cuda_ipc / cuda_copy in the ucxx-cu12 build);
TCP stages it through host memory. Skipped where no GPU is visible.
"""

from __future__ import annotations

import pytest
import torch
from kvt_peer import NUM_BLOCKS, Peer

from kvtransfer import TransferDescriptor

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("transport", ["ucx", "tcp"])
def test_cuda_to_cuda_transfer(transport):
    if transport == "ucx":
        pytest.importorskip("ucxx")
    receiver = Peer("receiver", transport, device="cuda")
    sender = Peer("sender", transport, seed=3, device="cuda")
    try:
        desc = receiver.call("reserve", "gpu", 12, 60.0, timeout=90)
        d = TransferDescriptor.from_bytes(desc)
        src = [5, 6, 7, 8, 20, 21, 40, 41, 42, 43, 44, 60]
        sender.call("send", desc, [(src[:7], 0), (src[7:], 7)], 3, timeout=90)
        assert receiver.call("outcome", "gpu")["first_token"] == 3
        assert receiver.call("digests", list(d.block_ids)) == sender.call("digests", src)
        receiver.call("finish_sequence", "gpu")
        assert receiver.call("free") == NUM_BLOCKS - 1
    finally:
        sender.close()
        receiver.close()
