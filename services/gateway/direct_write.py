"""Writing a stream's chunks to the client's socket from the delivery reader, without a turn of its task.

An SSE chunk used to travel from the delivery reader (delivery.py) to the socket
by waking the stream's task, which resumed a chain of async generators
(core.follow, responses.sse_events, Starlette's streaming response) and sent the
event down through every ASGI middleware to uvicorn. With 1,000 open streams a
read of the delivery stream carries 35-64 chunks, and each woke its own task:
the last of a read went out after all the others' chains had run, interleaved
with whatever else the loop had ready (``pdserve bench frontdoor``, BENCHMARKS.md).

Here a stream whose task is parked waiting for events takes a chunk straight
from the reader: the reader formats it (the stream's own formatter, so ids,
logprobs offsets and metrics are what the task would have made) and hands the
bytes to the HTTP server's ``send`` for the connection, which writes them to the
socket's transport without waiting. Everything else still goes through the
task: the opening, the final and error events, heartbeats, the end of the
body, and any chunk while the task is busy or has events in hand (so the
order on the wire is the order of the entry ids).

The server's ``send`` is uvicorn's, captured by ``RawSendCapture`` around the
whole application; it only waits when the socket's buffer is over its high-water
mark (the client reads slowly), and ``DirectWriter.ready`` says no then, so the
chunk takes the task's path and waits there. Under another server (or in
tests that call the application in process) there is no captured ``send`` and
every chunk takes the task's path. The middlewares see the response's start
and end, not its direct chunks: none of them reads bodies (http_metrics.py
counts statuses, http_errors.py and Starlette's handlers track whether a
response started).
"""

from __future__ import annotations

import logging

from prometheus_client import Counter

log = logging.getLogger(__name__)

RAW_SEND = "pdserve.raw_send"  # the scope key of the server's own send for this connection

SSE_CHUNKS = Counter("pdserve_gateway_sse_chunks_total",
                     "SSE chunk events written, by path: direct (from the delivery reader) or task "
                     "(through the stream's task and the ASGI middlewares).", ["path"])
_DIRECT, _TASK = SSE_CHUNKS.labels("direct"), SSE_CHUNKS.labels("task")


def count_task_chunk() -> None:
    _TASK.inc()


class RawSendCapture:
    """The outermost ASGI layer: keeps the server's ``send`` in the scope for ``DirectWriter``."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope[RAW_SEND] = send
        await self.app(scope, receive, send)


class DirectWriter:
    """Writes a response's body bytes now, from any task, when the server would not wait to take them."""

    def __init__(self, send):
        self._send = send
        cycle = getattr(send, "__self__", None)  # uvicorn's RequestResponseCycle: its flow control and state
        flow = getattr(cycle, "flow", None)
        known = all(hasattr(cycle, a) for a in ("disconnected", "response_started", "response_complete"))
        self._cycle = cycle if known and hasattr(flow, "write_paused") else None

    @classmethod
    def of(cls, scope) -> DirectWriter | None:
        send = scope.get(RAW_SEND)
        writer = cls(send) if send is not None else None
        return writer if writer is not None and writer._cycle is not None else None

    def ready(self) -> bool:
        """True when ``write`` would finish at once: the response started, is not over, the client is there
        and the socket's buffer is under its high-water mark."""
        cycle = self._cycle
        return (cycle.response_started and not cycle.response_complete and not cycle.disconnected
                and not cycle.flow.write_paused)

    def write(self, body: bytes) -> None:
        """Hand ``body`` to the server (call only when ``ready()``): its send runs to the end without waiting."""
        step = self._send({"type": "http.response.body", "body": body, "more_body": True})
        try:
            step.send(None)
        except StopIteration:
            _DIRECT.inc()
            return
        step.close()
        raise RuntimeError("the server's send waited although the connection was ready")
