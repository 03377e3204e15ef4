"""Responses API objects kept in Redis, for ``GET /v1/responses/{id}`` and ``previous_response_id``.

``pd:gw:resp:<response_id>`` (a string, JSON, TTL ``ttl_s``)::

    {"tenant": str,                 only this tenant finds it (another gets a 404, as for a missing one)
     "response": {...},             the Response object as last sent (in_progress, then completed/...)
     "conversation": [{"role", "content"}]}
                                    the messages a follow-up continues from: the earlier conversation,
                                    this response's input and its output (never its instructions)

Written when the response is created (so it can be fetched while it runs) and
again when it ends; ``store: false`` writes nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


def response_key(response_id: str) -> str:
    return f"pd:gw:resp:{response_id}"


@dataclass
class StoredResponse:
    response: dict
    conversation: list[dict]


class ResponseStore:
    def __init__(self, redis, ttl_s: int):
        if type(ttl_s) is not int or ttl_s < 1:
            raise ValueError(f"ttl_s must be an int >= 1; got {ttl_s!r}")
        self.redis = redis
        self.ttl_s = ttl_s

    async def save(self, tenant: str, response: dict, conversation: list[dict]) -> None:
        value = json.dumps({"tenant": tenant, "response": response, "conversation": conversation})
        await self.redis.set(response_key(response["id"]), value, ex=self.ttl_s)

    async def load(self, tenant: str, response_id: str) -> StoredResponse | None:
        if len(response_id) > 128:
            return None
        raw = await self.redis.get(response_key(response_id))
        if raw is None:
            return None
        data = json.loads(raw)
        if data.get("tenant") != tenant:
            return None
        return StoredResponse(data["response"], data["conversation"])
