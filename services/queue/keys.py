"""Where the queue lives in Redis; the layout itself is described in the package docstring.

Every queue key carries the hash tag ``{q}`` so that Lua scripts and MULTI
blocks may touch the tier streams, the dead-letter stream, the admission hash
and a request's state key together in Redis Cluster.

Result streams are tagged by the gateway that queued the request: its request
ids are ``<tag>.<hex>`` with the tag ``gw-<hex>`` naming the gateway process,
so every open request of one gateway has its result stream in one slot with
that gateway's delivery stream (``pd:res:{<tag>}:inbox``), and a writer can
append to both in one Lua script. Anyone who knows a request id knows where its
results are (routers, decode workers, another gateway resuming it). Request ids
without such a tag keep a slot of their own (``pd:res:{<request_id>}``) and
have no delivery stream.
"""

from __future__ import annotations

import re

DEAD_STREAM = "pd:{q}:dead"
ADMISSION_KEY = "pd:{q}:admission"
_TAGGED = re.compile(r"(gw-[0-9a-f]{8,32})\.[A-Za-z0-9._:-]+")


def tier_stream(tier: str) -> str:
    return f"pd:{{q}}:req:{tier}"


def state_key(request_id: str) -> str:
    return f"pd:{{q}}:state:{request_id}"


def delivery_tag(request_id: str) -> str | None:
    """The gateway tag of a request id (``gw-<hex>`` before the first dot), or None."""
    m = _TAGGED.fullmatch(request_id)
    return m.group(1) if m else None


def result_stream(request_id: str) -> str:
    tag = delivery_tag(request_id)
    return f"pd:res:{{{request_id}}}" if tag is None else f"pd:res:{{{tag}}}:{request_id}"


def fence_key(request_id: str) -> str:
    """The attempt allowed to write the request's chunks (results.py), in its result stream's slot."""
    return f"{result_stream(request_id)}:fence"


def inbox_stream(tag: str) -> str:
    """A gateway's delivery stream: a copy of every result event of its requests, read by that gateway."""
    return f"pd:res:{{{tag}}}:inbox"
