"""The one block-hash function, shared by workers and routers.

A block's hash chains its parent's hash, the model namespace and its token ids,
so equal hashes mean equal prefixes (up to collisions, which a cache hit guards
against by comparing the stored tokens). blake2b with a fixed key: stable
across processes and machines, unlike Python's ``hash``.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

_KEY = b"pdserve-block-hash-v1"


def request_namespace(namespace: str, lora: str | None) -> str:
    """The namespace a request's blocks hash in: the engine's, plus its LoRA adapter's name, so a
    block computed under one adapter (or none) never serves another (workers and routers alike)."""
    return namespace if lora is None else f"{namespace}|lora:{lora}"


def hash_block(parent: int | None, token_ids: Sequence[int], namespace: str) -> int:
    h = hashlib.blake2b(digest_size=8, key=_KEY)
    h.update((parent or 0).to_bytes(8, "little"))
    h.update(namespace.encode())
    h.update(b"\0")
    h.update(array("I", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int, namespace: str) -> list[int]:
    """Hashes of every *full* block of ``token_ids``, in order."""
    hashes: list[int] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], namespace)
        hashes.append(parent)
    return hashes
