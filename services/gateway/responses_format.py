"""Result stream events -> Responses API objects: the ``Response``, and its typed stream events.

A response's output is an assistant message with one ``output_text`` part, and, when the
request has tools, the calls the model made as ``function_call`` items (after the message,
which is left out when the output is calls alone; responses_tools.py). Its stream (each event
``event: <type>``, with a ``sequence_number``)::

    response.created, response.in_progress                 the Response, status in_progress
    response.output_item.added, response.content_part.added  the message, the empty text part
    response.output_text.delta                             one per chunk event with text
    response.output_text.done, response.content_part.done, response.output_item.done
    response.completed | response.incomplete               finish reason stop | length (or abort)
    error, response.failed                                 instead, when the request fails

With tools, the text is held back until the output ends (a call is only known as one once it
is complete): then each item's events come at once, a call's as ``response.output_item.added``,
``response.function_call_arguments.delta`` / ``.done``, ``response.output_item.done``.

The status follows the finish reason: ``stop`` completed, ``length`` incomplete
(``max_output_tokens``), ``abort`` cancelled; an error event makes it failed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from services.gateway import responses_tools, tools
from services.gateway.openai_format import answered_by
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
    echo: dict = field(default_factory=lambda: responses_tools.echo({}))  # tools, tool_choice, text.format

    @property
    def response_id(self) -> str:
        return f"resp_{self.record.request_id}"

    @property
    def message_id(self) -> str:
        return f"msg_{self.record.request_id}"


def _part(text: str, logprobs: list | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _logprobs(entries: list[dict] | None) -> list[dict]:
    """The result stream's logprob entries in the Responses API's shape."""
    def token(e: dict) -> dict:
        t = e.get("token", "")
        return {"token": t, "logprob": e.get("logprob", 0.0), "bytes": list(t.encode("utf-8", "replace"))}
    return [{**token(e), "top_logprobs": [token(t) for t in e.get("top") or []]} for e in entries or []]


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
        self.logprobs: list[dict] = []  # every token's, when the request asked for them
        self.last_logprobs: list[dict] = []  # the latest chunk's
        self.output_tokens = 0
        self.tool_choice = tools.ToolChoice.loads(ctx.record.tools)
        self.response = self.snapshot("in_progress")

    def add(self, data: dict) -> str:
        answered_by(self.ctx.record, data)
        text = data.get("text") or ""
        self.text.append(text)
        self.last_logprobs = _logprobs(data.get("logprobs"))
        self.logprobs += self.last_logprobs
        self.output_tokens += len(data.get("token_ids") or [])
        return text

    def message(self, status: str, content: bool = True, text: str | None = None) -> dict:
        text = "".join(self.text) if text is None else text
        return {"id": self.ctx.message_id, "type": "message", "role": "assistant", "status": status,
                "content": [_part(text, self.logprobs)] if content else []}

    def split(self) -> tuple[str | None, list[dict]]:
        """(the message's text or None, the calls) of the output so far."""
        return responses_tools.split_output(self.output_text(), self.tool_choice)

    def items(self, status: str) -> list[dict]:
        text, calls = self.split()
        out = [self.message(status, text=text)] if text is not None or not calls else []
        rid = self.ctx.record.request_id
        return out + [responses_tools.call_item(rid, i, c, status) for i, c in enumerate(calls)]

    def turn_text(self) -> str:
        """The output as the next turn's assistant message: calls in the model's call format."""
        text, calls = self.split()
        rendered = tools.render_calls([{"function": c} for c in calls])
        return "\n".join(part for part in (text if calls else self.output_text(), rendered) if part)

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
               "model": ctx.record.model, "output": self.items(_item_status(status)) if done else [],
               "previous_response_id": ctx.previous_response_id,
               "reasoning": None, "store": ctx.store, "temperature": ctx.temperature, **ctx.echo,
               "top_p": ctx.top_p, "truncation": "disabled", "metadata": ctx.metadata}
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
        started = [self._event("response.created", response=self.response),
                   self._event("response.in_progress", response=self.response)]
        return started if self.tool_choice is not None else started + self._message_opening()

    def _message_opening(self) -> list[dict]:
        return [self._event("response.output_item.added", output_index=0, item=self.message("in_progress", False)),
                self._event("response.content_part.added", **self._at(), part=_part(""))]

    def _message_end(self, text: str, item: dict) -> list[dict]:
        return [self._event("response.output_text.done", **self._at(), text=text, logprobs=self.logprobs),
                self._event("response.content_part.done", **self._at(), part=_part(text, self.logprobs)),
                self._event("response.output_item.done", output_index=0, item=item)]

    def chunk(self, data: dict) -> list[dict]:
        text = self.add(data)
        if self.tool_choice is not None:
            return []  # held until the end: calls are told from text once the output is complete
        if not text and not self.last_logprobs:
            return []
        return [self._event("response.output_text.delta", **self._at(), delta=text, logprobs=self.last_logprobs)]

    def final(self, data: dict) -> list[dict]:
        response = self.finish(data)
        ended = "response.completed" if response["status"] == "completed" else "response.incomplete"
        if self.tool_choice is None:
            return self._message_end(self.output_text(), response["output"][0]) + [self._event(ended, response=response)]
        out = []
        for index, item in enumerate(response["output"]):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                out += self._message_opening()
                out += [self._event("response.output_text.delta", **self._at(), delta=text,
                                    logprobs=self.logprobs)] if text else []
                out += self._message_end(text, item)
                continue
            at = {"item_id": item["id"], "output_index": index}
            out += [self._event("response.output_item.added", output_index=index,
                                item={**item, "arguments": "", "status": "in_progress"}),
                    self._event("response.function_call_arguments.delta", **at, delta=item["arguments"]),
                    self._event("response.function_call_arguments.done", **at, arguments=item["arguments"]),
                    self._event("response.output_item.done", output_index=index, item=item)]
        return out + [self._event(ended, response=response)]

    def failure(self, body: dict) -> list[dict]:
        error = body.get("error") or {}
        return [self._event("error", code=error.get("code"), message=str(error.get("message") or "failed"),
                            param=error.get("param")),
                self._event("response.failed", response=self.fail(body))]


class ResponseAggregate(ResponseBuilder):
    """The whole Response for a client that does not stream (responses.json_response)."""

    def body(self, final: dict) -> dict:
        answered_by(self.ctx.record, final)
        return self.finish(final)
