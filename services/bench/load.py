"""The load generator every serving benchmark shares: what to send, how (open or closed loop), what came back.

    items = [OpenAIRequest("chat", prompt, max_tokens=16, stream=True), ...]
    client = OpenAIClient("127.0.0.1", 8000, model)
    samples, wall = await open_loop(client.send, items, rate=4.0, seed=0)   # Poisson arrivals
    samples, wall = await open_loop(client.send, items, rate=math.inf)      # a burst: all at once
    samples, wall = await closed_loop(client.send, items, clients=16)       # 16 clients, one request each
                                                                             # at a time, back to back
``send`` is any coroutine ``item -> Sample`` (``bench serve`` also sends the
same items to the router's gRPC API), so both paths of a comparison run under
the same loop. ``OpenAIClient`` speaks the OpenAI HTTP API through the small
asyncio client in http_client.py (one connection per request, as independent
clients would), streaming or not, so one process on a busy two-core machine
can hold ten thousand clients. A ``Sample`` records what a user would notice:
the outcome (completed, refused with Retry-After, or anything else), time to
first token, the gaps between chunks, end-to-end time, output tokens, and, when
asked, every chunk's SSE ``id:`` with the wall time it was read.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from services.bench.http_client import Connection

COMPLETED, REFUSED, OTHER = "completed", "refused", "other"


@dataclass
class OpenAIRequest:
    api: str  # chat | completion
    prompt: str | list[int]  # completions take token ids too (a model without a tokenizer)
    max_tokens: int
    stream: bool = True
    priority: str | None = None  # x-pdserve-priority
    timeout_s: float | None = None  # x-pdserve-timeout: how long the client is willing to wait
    extra: dict = field(default_factory=dict)  # more body fields (temperature, ...)


@dataclass
class Sample:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    gaps: list[float] = field(default_factory=list)  # between content chunks
    tokens: int = 0
    error: str = ""
    status: int = 0
    retry_after: bool = False  # a refusal that said when to come back
    request_id: str = ""
    chunks: list[tuple[str, float, float | None]] = field(default_factory=list)  # (SSE id, read, at the socket)
    text: str = ""  # the streamed output, joined (greedy-output checks compare it)

    @property
    def outcome(self) -> str:
        if self.ok:
            return COMPLETED
        if self.status in (429, 503) and self.retry_after:
            return REFUSED
        return OTHER


class OpenAIClient:
    def __init__(self, host: str, port: int, model: str, record_chunks: bool = False,
                 on_request_id: Callable[[str], None] | None = None, timeout_s: float = 900.0,
                 socket_times: bool = False):
        self.host, self.port, self.model = host, port, model
        self.record_chunks = record_chunks  # keep each chunk's (id, time read, time at the socket): latency studies
        self.socket_times = socket_times  # the kernel's stamp of each chunk's arrival (http_client.py)
        self.on_request_id = on_request_id  # told each request id as soon as its headers arrive
        self.timeout_s = timeout_s
        self.open = 0  # requests sent and not yet answered in full (open streams, waiting clients)
        self.peak_open = 0

    def body(self, item: OpenAIRequest) -> tuple[str, dict]:
        body = {"model": self.model, "max_tokens": item.max_tokens, "temperature": 0, "stream": item.stream,
                **item.extra}
        if item.api == "chat":
            body["messages"] = [{"role": "user", "content": item.prompt}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = item.prompt
            path = "/v1/completions"
        if item.stream:
            body["stream_options"] = {"include_usage": True}
        return path, body

    async def send(self, item: OpenAIRequest) -> Sample:
        path, body = self.body(item)
        headers = {"x-pdserve-priority": item.priority} if item.priority else {}
        if item.timeout_s:
            headers["x-pdserve-timeout"] = f"{item.timeout_s:g}"
        start = time.perf_counter()
        state = _StreamState(item.api, start, self.record_chunks)

        def on_headers(status: int, got: dict[str, str]) -> None:
            rid = got.get("x-request-id", "")
            state.request_id = rid
            if rid and status == 200 and self.on_request_id is not None:
                self.on_request_id(rid)

        self.open += 1
        self.peak_open = max(self.peak_open, self.open)
        try:
            response = await asyncio.wait_for(
                Connection(self.host, self.port, self.socket_times).request("POST", path, body, headers, on_headers=on_headers,
                                                         on_event=state.on_event if item.stream else None),
                self.timeout_s)
        except Exception as exc:  # a refused or dropped connection, a timeout: counted, never raised
            return Sample(False, error=f"{type(exc).__name__}: {exc}"[:200], request_id=state.request_id)
        finally:
            self.open -= 1
        end = time.perf_counter()
        retry_after = "retry-after" in response.headers
        if response.status != 200:
            return Sample(False, error=f"HTTP {response.status}: {response.body[:200]!r}", status=response.status,
                          retry_after=retry_after, request_id=state.request_id)
        if item.stream:
            return state.sample(end)
        try:
            answer = json.loads(response.body)
            tokens = answer["usage"]["completion_tokens"]
        except (ValueError, KeyError, TypeError) as exc:
            return Sample(False, error=f"unreadable JSON body: {exc}", status=200, request_id=state.request_id)
        choice = (answer.get("choices") or [{}])[0]
        text = (choice.get("message") or {}).get("content") or choice.get("text") or ""
        return Sample(True, end - start, end - start, [], tokens, status=200, request_id=state.request_id, text=text)


class _StreamState:
    """One SSE response read as it arrives: content chunk times, usage, the end, an error event."""

    def __init__(self, api: str, start: float, record: bool):
        self.api, self.start, self.record = api, start, record
        self.first = self.last = None
        self.gaps: list[float] = []
        self.tokens = self.content_chunks = 0
        self.done = False
        self.error = ""
        self.request_id = ""
        self.chunks: list[tuple[str, float, float | None]] = []  # (SSE id, read, reached the socket)
        self.pieces: list[str] = []

    def on_event(self, event_id: str | None, data: str, wall: float, at_socket: float | None = None) -> None:
        if data == "[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except ValueError:
            self.error = f"not JSON: {data[:80]!r}"
            return
        if "error" in event:
            self.error = str(event["error"].get("message", "error"))[:200]
            return
        if event.get("usage"):
            self.tokens = event["usage"].get("completion_tokens", 0)
        choices = event.get("choices") or []
        piece = (choices[0].get("delta", {}).get("content") if self.api == "chat" else choices[0].get("text")) \
            if choices else None
        if not piece and choices and self.api != "chat":  # a model without a tokenizer: its tokens' logprobs
            piece = (choices[0].get("logprobs") or {}).get("tokens")
        if piece:
            now = time.perf_counter()
            if self.first is None:
                self.first = now
            else:
                self.gaps.append(now - self.last)
            self.last = now
            self.content_chunks += 1
            self.pieces.append(piece if isinstance(piece, str) else "".join(piece))  # logprobs' tokens: a list
        if self.record and event_id:
            self.chunks.append((event_id, wall, at_socket))

    def sample(self, end: float) -> Sample:
        if self.error or not self.done:
            return Sample(False, error=self.error or "the stream ended without [DONE]", status=200,
                          request_id=self.request_id, chunks=self.chunks)
        return Sample(True, (self.first or end) - self.start, end - self.start, self.gaps,
                      self.tokens or self.content_chunks, status=200, request_id=self.request_id,
                      chunks=self.chunks, text="".join(self.pieces))


Send = Callable[[object], Awaitable[Sample]]


async def open_loop(send: Send, items: Sequence, rate: float, seed: int = 0,
                    poisson: bool = True) -> tuple[list[Sample], float]:
    """Each item sent at its arrival time, Poisson at ``rate`` per second (else evenly spaced; ``math.inf``:
    all at once)."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0; got {rate!r}")
    rng = random.Random(seed)
    start = time.perf_counter()
    tasks, at = [], 0.0
    for item in items:
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(item)))
        if not math.isinf(rate):
            at += rng.expovariate(rate) if poisson else 1 / rate
    samples = await asyncio.gather(*tasks)
    return list(samples), time.perf_counter() - start


async def closed_loop(send: Send, items: Sequence, clients: int) -> tuple[list[Sample], float]:
    """``clients`` concurrent clients, each sending its next item as soon as its previous one is answered."""
    if clients < 1:
        raise ValueError(f"clients must be >= 1; got {clients!r}")
    samples: list[Sample | None] = [None] * len(items)
    next_index = iter(range(len(items)))

    async def client() -> None:
        for i in next_index:  # shared: each item goes to whichever client is free first
            samples[i] = await send(items[i])

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(min(clients, len(items)))))
    return [s for s in samples if s is not None], time.perf_counter() - start


def outcomes(samples: Sequence[Sample]) -> dict[str, int]:
    counts = {COMPLETED: 0, REFUSED: 0, OTHER: 0}
    for s in samples:
        counts[s.outcome] += 1
    return counts
