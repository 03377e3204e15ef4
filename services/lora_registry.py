"""The LoRA adapters a deployment serves, in Redis: the hash ``pd:loras`` (name -> PEFT directory).

Workers started with ``--lora NAME=PATH`` add theirs; the gateway's admin endpoint
(``--enable-lora-admin``) adds and removes adapters at run time. Each worker follows the hash
every heartbeat (an adapter added is registered with its engine, whose slots read the tensors
when a request first needs them; one removed is forgotten), and announces what it serves and
holds in its registry entry (``WorkerInfo.loras`` / ``loaded_loras``), which the router prefers.
The gateway reads the hash to list the adapters (/v1/models) and to refuse an unknown one
before a request is queued. The path must be readable by every worker (a shared volume).
"""

from __future__ import annotations

KEY = "pd:loras"


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def read_loras(redis) -> dict[str, str]:
    """Every adapter: name -> path."""
    return {_text(k): _text(v) for k, v in (await redis.hgetall(KEY)).items()}


async def add_lora(redis, name: str, path: str) -> None:
    await redis.hset(KEY, name, path)


async def remove_lora(redis, name: str) -> bool:
    return bool(await redis.hdel(KEY, name))


def split_model(requested: str, base: str) -> tuple[str | None, bool]:
    """``model`` of a request -> (adapter name or None for the base model, whether it was written
    ``<base>:<adapter>``, SGLang's form, which names an adapter for certain)."""
    if requested == base:
        return None, False
    if requested.startswith(base + ":"):
        return requested[len(base) + 1:], True
    return requested, False
