"""What a chaos-bench client sends and what it counts, through the official ``openai`` client.

Every request asks for ``logprobs``, so each streamed event says how many tokens it
carries; with ``include_usage`` the server also says how many it generated. A
client therefore knows, from what it actually received (across a ``Last-Event-ID``
resume too), whether a token came twice (a token-bearing SSE id seen again, or more
tokens than the usage) or was skipped (fewer). An outcome is one of:

    completed   the whole answer (streams: [DONE], usage, no error event)
    errored     a clear, documented error reached the client: 429/503 with Retry-After,
                a 4xx with an OpenAI error body, or a final SSE error event
    lost        anything else: no answer, a 5xx without Retry-After, a stream cut without
                a final event, or no answer by the client's deadline
    abandoned   the client hung up on purpose and never came back (client-disconnect)

The SSE is read raw (``with_streaming_response``) because the ``openai`` client's
parsed stream hides the event ids a resume needs.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
import openai

COMPLETED, ERRORED, LOST, ABANDONED = "completed", "errored", "lost", "abandoned"


@dataclass
class ChaosRequest:
    prompt: str
    max_tokens: int
    stream: bool = True
    priority: str = "standard"
    hang_up_after: int = 0  # streams: drop the connection after this many token-bearing events (0: never)
    resume: bool = True  # after hanging up: come back with Last-Event-ID (else abandon the request)


@dataclass
class Outcome:
    kind: str
    sent_at: float  # time.monotonic()
    done_at: float = 0.0
    detail: str = ""
    status: int = 0
    request_id: str = ""
    tokens_seen: int = 0  # token entries (logprobs) the client received, all connections together
    tokens_expected: int = 0  # usage.completion_tokens
    duplicate_tokens: int = 0
    token_gaps: int = 0
    resumed: bool = False


@dataclass
class _Received:
    """The SSE events of one request, possibly over two connections."""

    tokens: int = 0
    usage: int | None = None
    done: bool = False
    error: str = ""
    last_id: str | None = None
    token_ids: dict[str, int] = field(default_factory=dict)  # SSE id -> tokens it carried
    duplicate: int = 0

    def event(self, event_id: str | None, data: str) -> int:
        """Record one event; returns how many tokens it carried."""
        if event_id:
            self.last_id = event_id
        if data == "[DONE]":
            self.done = True
            return 0
        body = json.loads(data)
        if "error" in body:
            self.error = str(body["error"].get("message", "error"))[:200]
            return 0
        if body.get("usage"):
            self.usage = body["usage"].get("completion_tokens")
        n = 0
        for choice in body.get("choices") or []:
            n += len((choice.get("logprobs") or {}).get("content") or [])
        if n and event_id:
            if event_id in self.token_ids:
                self.duplicate += n
            self.token_ids[event_id] = n
        self.tokens += n
        return n


async def _read_sse(lines, received: _Received, stop_after: int = 0) -> bool:
    """Feed SSE lines into ``received``; True when it stopped early (after ``stop_after`` token events)."""
    event_id, data, token_events = None, [], 0
    async for line in lines:
        if line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
        elif not line and data:
            if received.event(event_id, "\n".join(data)):
                token_events += 1
                if stop_after and token_events >= stop_after:
                    return True
            event_id, data = None, []
    if data:
        received.event(event_id, "\n".join(data))
    return False


class ChaosClient:
    def __init__(self, base_url: str, model: str, deadline_s: float = 180.0, resume_delay_s: float = 1.0):
        self.base_url, self.model, self.deadline_s = base_url.rstrip("/"), model, deadline_s
        self.resume_delay_s = resume_delay_s
        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=64)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(deadline_s, connect=30.0), limits=limits)
        self.openai = openai.AsyncOpenAI(base_url=self.base_url, api_key="none", max_retries=0,
                                         http_client=self.http)

    async def close(self) -> None:
        await self.http.aclose()

    async def send(self, item: ChaosRequest) -> Outcome:
        out = Outcome(LOST, time.monotonic())
        try:
            await asyncio.wait_for(self._send(item, out), self.deadline_s)
        except TimeoutError:
            out.kind, out.detail = LOST, f"no answer in {self.deadline_s:g} s"
        except openai.APIStatusError as exc:
            out.status = exc.status_code
            retry_after = "retry-after" in exc.response.headers
            body = exc.body if isinstance(exc.body, dict) else {}
            documented = (exc.status_code in (429, 503) and retry_after) or \
                (400 <= exc.status_code < 500 and "message" in body)
            out.kind = ERRORED if documented else LOST
            out.detail = f"HTTP {exc.status_code}: {str(exc.message)[:160]}"
        except (openai.APIError, httpx.HTTPError, OSError, ValueError) as exc:
            out.kind, out.detail = LOST, f"{type(exc).__name__}: {exc}"[:200]
        out.done_at = time.monotonic()
        return out

    async def _send(self, item: ChaosRequest, out: Outcome) -> None:
        kwargs = {"model": self.model, "max_tokens": item.max_tokens, "temperature": 0, "logprobs": True,
                  "messages": [{"role": "user", "content": item.prompt}],
                  "extra_headers": {"x-pdserve-priority": item.priority,
                                    "x-pdserve-timeout": f"{self.deadline_s - 10:g}"}}
        if not item.stream:
            answer = await self.openai.chat.completions.create(**kwargs)
            out.tokens_seen = len(answer.choices[0].logprobs.content or []) if answer.choices[0].logprobs else 0
            out.tokens_expected = answer.usage.completion_tokens
            out.request_id = answer.id
            self._tally(out, _Received(tokens=out.tokens_seen, usage=out.tokens_expected, done=True))
            return
        received = _Received()
        async with self.openai.chat.completions.with_streaming_response.create(
                stream=True, stream_options={"include_usage": True}, **kwargs) as resp:
            out.request_id = resp.headers.get("x-request-id", "")
            hung_up = await _read_sse(resp.iter_lines(), received, item.hang_up_after)
        if hung_up:
            if not item.resume:
                out.kind, out.detail = ABANDONED, "hung up on purpose"
                return
            await asyncio.sleep(self.resume_delay_s)
            out.resumed = True
            headers = {"Last-Event-ID": received.last_id} if received.last_id else {}
            async with self.http.stream("GET", f"{self.base_url}/requests/{out.request_id}/events",
                                        headers=headers) as resp:
                if resp.status_code != 200:
                    out.kind, out.status = LOST, resp.status_code
                    out.detail = f"resume answered HTTP {resp.status_code}"
                    return
                await _read_sse(resp.aiter_lines(), received)
        self._tally(out, received)

    @staticmethod
    def _tally(out: Outcome, received: _Received) -> None:
        out.tokens_seen = received.tokens
        if received.error:
            out.kind, out.detail = ERRORED, f"error event: {received.error}"
            return
        if not received.done or received.usage is None:
            out.kind, out.detail = LOST, "the stream ended without [DONE]" if not received.done else "no usage"
            return
        out.kind = COMPLETED
        out.tokens_expected = received.usage
        out.duplicate_tokens = max(received.duplicate, received.tokens - received.usage)
        out.token_gaps = max(0, received.usage - (received.tokens - received.duplicate))
