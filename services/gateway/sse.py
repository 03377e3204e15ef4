"""Server-sent events on the wire: ``id:`` (the result stream entry id), ``data:`` JSON, ``[DONE]``.

An event with an ``id:`` line is one a client may resume after (``Last-Event-ID``);
events derived from one stream entry carry its id only on the last of them, so
a client cut off between them resumes before the entry and misses nothing.
"""

from __future__ import annotations

import json
import re

from services.errors import InvalidRequestError

DONE = b"data: [DONE]\n\n"
HEARTBEAT = b": keep-alive\n\n"  # a comment: clients ignore it, proxies see traffic
MEDIA_TYPE = "text/event-stream"
# Not buffered anywhere on the way: nginx honours X-Accel-Buffering, caches honour no-cache.
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}

_EVENT_ID = re.compile(r"\d{1,20}(-\d{1,20})?")


def encode(data: dict, event_id: str | None = None) -> bytes:
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    head = f"id: {event_id}\n" if event_id else ""
    return f"{head}data: {payload}\n\n".encode()


def resume_id(header: str | None, query: str | None = None) -> str:
    """The id to resume after: the ``Last-Event-ID`` header, else ``?last_event_id=``, else the start."""
    value = (header or query or "").strip()
    if not value:
        return "0"
    if not _EVENT_ID.fullmatch(value):
        raise InvalidRequestError(f"Last-Event-ID must be an event id this server sent, got {value[:40]!r}",
                                  param="Last-Event-ID")
    return value
