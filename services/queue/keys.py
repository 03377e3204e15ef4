"""Where the queue lives in Redis; the layout itself is described in the package docstring.

Every queue key carries the hash tag ``{q}`` so that Lua scripts and MULTI
blocks may touch the tier streams, the dead-letter stream, the admission hash
and a request's state key together in Redis Cluster. Result streams are tagged
by request id instead: they are written by decode workers, one slot each.
"""

from __future__ import annotations

DEAD_STREAM = "pd:{q}:dead"
ADMISSION_KEY = "pd:{q}:admission"


def tier_stream(tier: str) -> str:
    return f"pd:{{q}}:req:{tier}"


def state_key(request_id: str) -> str:
    return f"pd:{{q}}:state:{request_id}"


def result_stream(request_id: str) -> str:
    return f"pd:res:{{{request_id}}}"
