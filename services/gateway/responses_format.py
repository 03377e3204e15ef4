"""Result stream events -> Responses API objects: the ``Response``, and its typed stream events.

A response has one output item, an assistant message with one ``output_text``
part. Its stream (each event ``event: <type>``, with a ``sequence_number``)::

    response.created, response.in_progress                 the Response, status in_progress
    response.output_item.added, response.content_part.added  the message, the empty text part
    response.output_text.delta                             one per chunk event with text
    response.output_text.done, response.content_part.done, response.output_item.done
    response.completed | response.incomplete               finish reason stop | length (or abort)
    error, response.failed                                 instead, when the request fails

The status follows the finish reason: ``stop`` completed, ``length`` incomplete
(``max_output_tokens``), ``abort`` cancelled; an error event makes it failed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from services.gateway.request_record import RequestRecord

RESPONSE = "response"  # the request record's kind for this API


@dataclass
class ResponseContext:
    """What a Response object says besides its output: the request's settings, echoed back."""

    record: RequestRecord
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict = field(default_factory=dict)
    temperature: float = 1.0
    top_p: float = 1.0
    max_output_tokens: int | None = None
    user: str | None = None

    @property
    def response_id(self) -> str:
        return f"resp_{self.record.request_id}"

    @property
    def message_id(self) -> str:
        return f"msg_{self.record.request_id}"


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _status(finish_reason: str | None) -> str:
    return {"length": "incomplete", "abort": "cancelled"}.get(finish_reason or "stop", "completed")


def _error_code(error_type: str) -> str:
    """OpenAI's ResponseErrorCode for one of pdserve's error types."""
    if error_type in ("capacity_exceeded", "rate_limit_exceeded"):
        return "rate_limit_exceeded"
    return "invalid_prompt" if error_type == "invalid_request_error" else "server_error"


class ResponseBuilder:
    """One response's text so far and the Response object at each stage."""

    def __init__(self, ctx: ResponseContext):
        self.ctx = ctx
        self.text: list[str] = []
        self.output_tokens = 0
        self.response = self.snapshot("in_progress")

    def add(self, data: dict) -> str:
        text = data.get("text") or ""
        self.text.append(text)
        self.output_tokens += len(data.get("token_ids") or [])
        return text

    def message(self, status: str, content: bool = True) -> dict:
        return {"id": self.ctx.message_id, "type": "message", "role": "assistant", "status": status,
                "content": [_part("".join(self.text))] if content else []}

    def usage(self, final: dict) -> dict:
        u = final.get("usage") or {}
        prompt = int(u.get("prompt_tokens", self.ctx.record.prompt_tokens))
        output = int(u.get("completion_tokens", self.output_tokens))
        return {"input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": int(u.get("cached_prompt_tokens", 0)),
                                         "cache_write_tokens": 0},
                "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + output}

    def snapshot(self, status: str, final: dict | None = None, error: dict | None = None) -> dict:
        ctx = self.ctx
        done = status not in ("in_progress", "queued")
        out = {"id": ctx.response_id, "object": "response", "created_at": ctx.record.created, "status": status,
               "completed_at": None, "error": error, "incomplete_details": None,
               "instructions": ctx.instructions, "max_output_tokens": ctx.max_output_tokens,
               "model": ctx.record.model, "output": [self.message(_item_status(status))] if done else [],
               "parallel_tool_calls": True, "previous_response_id": ctx.previous_response_id,
               "reasoning": None, "store": ctx.store, "temperature": ctx.temperature,
               "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [], "top_p": ctx.top_p,
               "truncation": "disabled", "metadata": ctx.metadata}
        if final is not None:  # OpenAI's schema has no null usage: absent until known
            out["usage"] = self.usage(final)
        if status == "completed":
            out["completed_at"] = int(time.time())
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        if ctx.user is not None:
            out["user"] = ctx.user
        self.response = out
        return out

    def finish(self, final: dict) -> dict:
        return self.snapshot(_status(final.get("finish_reason")), final)

    def fail(self, body: dict) -> dict:
        error = body.get("error") or {}
        return self.snapshot("failed", error={"code": _error_code(str(error.get("type"))),
                                              "message": str(error.get("message") or "the request failed")})

    def output_text(self) -> str:
        return "".join(self.text)


def _item_status(status: str) -> str:
    return "completed" if status == "completed" else "incomplete"


class ResponseEvents(ResponseBuilder):
    """The typed stream events, in order (responses.sse_events gives them their ids)."""

    done = False  # no [DONE]: response.completed (or failed) ends the stream

    def __init__(self, ctx: ResponseContext):
        super().__init__(ctx)
        self.sequence = 0

    def _event(self, type_: str, **fields) -> dict:
        event = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _at(self) -> dict:
        return {"item_id": self.ctx.message_id, "output_index": 0, "content_index": 0}

    @staticmethod
    def event_name(payload: dict) -> str | None:
        return payload.get("type")

    def opening(self) -> list[dict]:
        return [self._event("response.created", response=self.response),
                self._event("response.in_progress", response=self.response),
                self._event("response.output_item.added", output_index=0, item=self.message("in_progress", False)),
                self._event("response.content_part.added", **self._at(), part=_part(""))]

    def chunk(self, data: dict) -> list[dict]:
        text = self.add(data)
        return [self._event("response.output_text.delta", **self._at(), delta=text, logprobs=[])] if text else []

    def final(self, data: dict) -> list[dict]:
        response = self.finish(data)
        text = self.output_text()
        ended = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [self._event("response.output_text.done", **self._at(), text=text, logprobs=[]),
                self._event("response.content_part.done", **self._at(), part=_part(text)),
                self._event("response.output_item.done", output_index=0, item=response["output"][0]),
                self._event(ended, response=response)]

    def failure(self, body: dict) -> list[dict]:
        error = body.get("error") or {}
        return [self._event("error", code=error.get("code"), message=str(error.get("message") or "failed"),
                            param=error.get("param")),
                self._event("response.failed", response=self.fail(body))]


class ResponseAggregate(ResponseBuilder):
    """The whole Response for a client that does not stream (responses.json_response)."""

    def body(self, final: dict) -> dict:
        return self.finish(final)
