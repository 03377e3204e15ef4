"""Moving KV-cache blocks between processes (prefill -> decode).

Decode side (owns the destination blocks)::

    receiver = Receiver(kv_cache, kv_spec, namespace, owner, TransferConfig(...))
    await receiver.start()
    pending = receiver.reserve(transfer_id, num_blocks, timeout_s)   # owner.reserve()
    send pending.descriptor.to_bytes() to the prefill side
    completion = await pending     # or TransferError, after owner.release()

Prefill side (reads its own blocks, holds nothing past a call)::

    sender = Sender(kv_cache, kv_spec, namespace, TransferConfig(...))
    desc = TransferDescriptor.from_bytes(data)
    await sender.send_blocks(desc, src_block_ids, dst_offset)   # per prefill chunk
    await sender.finish(desc, first_token, meta)                # or sender.abort(desc, reason)

Transports (``TransferConfig.transport``): ``ucx`` (default, ucxx; its put
scheme in ``ucx_puts.py``), ``tcp``, ``loopback``. Protocol: ``protocol.py``;
ownership: ``ownership.py``, ``receiver.py`` and ``sender.py``; metrics:
``stats.py``; benchmark: ``bench.py``.

What was verified where (November 2026):

- CPU KV caches, ucx (ucxx-cu12 0.52, UCX 1.21, one host: cma for the
  pulled and the put bytes, shared memory for the rest), tcp and loopback:
  tests/kvtransfer, on a 2-core machine without a GPU; the ucx tests run
  once as configured (small messages pulled whole) and once with every
  message split between pull and put (``ucx-put``).
- CUDA KV caches: not run yet (no GPU was lent for this work).
  tests/kvtransfer/test_kvtransfer_cuda.py moves CUDA blocks between two
  processes over ucx (cuda_ipc / cuda_copy, device memory handed to ucxx
  as is) and tcp (staged through host memory); it runs wherever a GPU is
  visible and is skipped elsewhere.
"""

from kvtransfer.config import TransferConfig
from kvtransfer.descriptor import PeerInfo, TransferDescriptor
from kvtransfer.ownership import BlockOwner, Completion, PendingTransfer
from kvtransfer.receiver import Receiver
from kvtransfer.sender import Sender
from kvtransfer.stats import TransferStats
from kvtransfer.transport import make_transport

__all__ = [
    "BlockOwner",
    "Completion",
    "PeerInfo",
    "PendingTransfer",
    "Receiver",
    "Sender",
    "TransferConfig",
    "TransferDescriptor",
    "TransferStats",
    "make_transport",
]
