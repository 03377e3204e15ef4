"""The decode side's contract for reserved blocks (STYLE rule 6: explicit ownership).

::

    BlockOwner.reserve()  ->  the Receiver may write into the blocks  ->  PendingTransfer resolves
                                                                          |- Completion: the blocks hold the
                                                                          |  prompt's KV and now belong to the
                                                                          |  caller's sequence; nothing released
                                                                          '- TransferError: the Receiver has
                                                                             already called owner.release(),
                                                                             exactly once, and nothing writes
                                                                             into the blocks any more

The decode engine implements ``BlockOwner`` over its block pool (allocation
under the transfer id, freeing on release) and awaits the ``PendingTransfer``.
It never frees the blocks of a failed transfer itself, and always frees those
of a completed one when that sequence ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvtransfer.descriptor import TransferDescriptor


class BlockOwner(Protocol):
    """The decode engine's block pool, as the receiver sees it."""

    def reserve(self, transfer_id: str, num_blocks: int) -> Sequence[int]:
        """Allocate ``num_blocks`` blocks for ``transfer_id``; raise ``CapacityError`` if it cannot."""

    def release(self, transfer_id: str, block_ids: Sequence[int]) -> None:
        """Free the blocks of a failed transfer (never called for a completed one)."""


@dataclass(frozen=True)
class Completion:
    transfer_id: str
    block_ids: tuple[int, ...]
    first_token: int
    meta: dict
    nbytes: int
    seconds: float  # from reserve() to the finish message


class PendingTransfer:
    """A reserved transfer: its descriptor, and an awaitable of how it ends."""

    def __init__(self, descriptor: TransferDescriptor, future: asyncio.Future):
        self.descriptor = descriptor
        self._future = future

    def __await__(self):
        return asyncio.shield(self._future).__await__()

    def done(self) -> bool:
        return self._future.done()
