"""Moving KV-cache blocks between processes (prefill -> decode).

Decode side (owns the destination blocks)::

    receiver = Receiver(kv_cache, namespace, owner, TransferConfig(...))
    await receiver.start()
    pending = receiver.reserve(transfer_id, num_blocks, timeout_s)   # owner.reserve()
    send pending.descriptor.to_bytes() to the prefill side
    completion = await pending     # or TransferError, after owner.release()

Prefill side (reads its own blocks, holds nothing past a call)::

    sender = Sender(kv_cache, namespace, TransferConfig(...))
    desc = TransferDescriptor.from_bytes(data)
    await sender.send_blocks(desc, src_block_ids, dst_offset)   # per prefill chunk
    await sender.finish(desc, first_token, meta)                # or sender.abort(desc, reason)

Transports (``TransferConfig.transport``, by name in ``registry.py``): ``ucx``
(default, ucxx; its put scheme in ``ucx_puts.py``), ``tcp``, ``loopback``.
Protocol: ``protocol.py``; ownership: ``ownership.py``, ``receiver.py`` and ``sender.py``; metrics:
``stats.py``; errors: ``errors.py``. kvtransfer imports nothing from ``services``:
the block shape is read off the cache tensor (``descriptor.BlockShape``). Its
benchmark is ``services/bench/transfer.py`` (``pdserve bench kvtransfer``).

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
from kvtransfer.descriptor import BlockShape, PeerInfo, TransferDescriptor
from kvtransfer.errors import TransferError
from kvtransfer.ownership import BlockOwner, Completion, PendingTransfer
from kvtransfer.receiver import Receiver
from kvtransfer.registry import make_transport
from kvtransfer.sender import Sender
from kvtransfer.stats import TransferStats

__all__ = [
    "BlockOwner",
    "BlockShape",
    "Completion",
    "PeerInfo",
    "PendingTransfer",
    "Receiver",
    "Sender",
    "TransferConfig",
    "TransferDescriptor",
    "TransferError",
    "TransferStats",
    "make_transport",
]
