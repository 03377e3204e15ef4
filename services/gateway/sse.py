"""Server-sent events on the wire: ``id:`` on every event, ``data:`` JSON, ``[DONE]``.

Every event carries an ``id:``, so a client cut off after any of them can resume
with ``Last-Event-ID`` and get exactly what follows, no duplicate and no gap::

    0-0          chat's opening (the assistant role): resuming after it skips it
    <entry>      the last (usually only) event made from a result stream entry
    <entry>.<k>  event k (from 0) of several made from one entry, not its last one
                 (the finish chunk before the usage chunk): resuming after it
                 rereads that entry and skips its events 0..k
    same as the event before: events that are not content (an error that did not
    come from the result stream, ``[DONE]``); resuming after them repeats nothing

A resumed stream from the start (no ``Last-Event-ID``, or ``0``) begins with the
opening again.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from services.errors import InvalidRequestError

DONE_DATA = "[DONE]"
# A comment line: clients ignore it, proxies see traffic. Not followed by a blank line: that would end
# an "event" of no data, which the openai client (whose decoder keeps the last event id, as the SSE spec
# says) hands on as an event and fails to parse as JSON mid-stream.
HEARTBEAT = b": keep-alive\n"
MEDIA_TYPE = "text/event-stream"
# Not buffered anywhere on the way: nginx honours X-Accel-Buffering, caches honour no-cache.
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}
OPENING_ID = "0-0"
START = "0"

_EVENT_ID = re.compile(r"(\d{1,20})(?:-(\d{1,20}))?(?:\.(\d{1,4}))?")
_MAX_SEQ = 2 ** 64 - 1


def encode(data: dict, event_id: str, event: str | None = None) -> bytes:
    """One event; ``event`` names its type (the Responses API's typed events), else it is a plain message."""
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}id: {event_id}\ndata: {payload}\n\n".encode()


def done(event_id: str) -> bytes:
    return f"id: {event_id}\ndata: {DONE_DATA}\n\n".encode()


def sub_id(entry_id: str, k: int) -> str:
    return f"{entry_id}.{k}"


@dataclass(frozen=True)
class ResumePoint:
    """Where a stream picks up: read result entries after ``after``; of the first one read, skip ``skip`` events."""

    event_id: str  # what the client sent (START: from the very beginning)
    after: str  # a result stream id (XREAD is exclusive)
    skip: int = 0

    @property
    def opening(self) -> bool:
        """Whether chat's opening is still to be sent."""
        return self.event_id == START


def resume_point(event_id: str) -> ResumePoint:
    match = _EVENT_ID.fullmatch(event_id)
    if match is None:
        raise InvalidRequestError(f"Last-Event-ID must be an event id this server sent, got {event_id[:40]!r}",
                                  param="Last-Event-ID")
    ms, seq, k = int(match[1]), int(match[2] or 0), match[3]
    if k is None:
        return ResumePoint(event_id, f"{ms}-{seq}")
    # reread the entry itself: XREAD after the id just before it
    before = f"{ms}-{seq - 1}" if seq else (f"{ms - 1}-{_MAX_SEQ}" if ms else "0-0")
    return ResumePoint(event_id, before, int(k) + 1)


def resume_id(header: str | None, query: str | None = None) -> str:
    """The id to resume after: the ``Last-Event-ID`` header, else ``?last_event_id=``, else the start."""
    value = (header or query or "").strip()
    if not value:
        return START
    resume_point(value)  # refuses what this server never sent
    return value
