"""Cancellation of a queued or running request (its client went away).

The gateway calls ``request_cancel``: a flag key (so a router that dequeues the
request later skips it) and a PUBLISH on ``CANCEL_CHANNEL`` (so the router
running it cancels its dispatch at once, which cancels the worker calls and
frees their blocks). Both are idempotent.
"""

from __future__ import annotations

CANCEL_CHANNEL = "pd:{q}:cancel"
_FLAG_TTL_S = 3600


def cancel_key(request_id: str) -> str:
    return f"pd:{{q}}:cancel:{request_id}"


async def request_cancel(redis, request_id: str) -> None:
    async with redis.pipeline(transaction=False) as pipe:
        pipe.set(cancel_key(request_id), 1, ex=_FLAG_TTL_S)
        pipe.publish(CANCEL_CHANNEL, request_id)
        await pipe.execute()


async def is_cancelled(redis, request_id: str) -> bool:
    return bool(await redis.exists(cancel_key(request_id)))
