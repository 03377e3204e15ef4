"""Result stream events -> OpenAI objects: stream chunks, or one response body.

Chat streams (``chat.completion.chunk``)::

    {"choices": [{"delta": {"role": "assistant", "content": ""}}]}     opening (not resumable)
    {"choices": [{"delta": {"content": "Hel"}, "logprobs": ...}]}      one per chunk event
    {"choices": [{"delta": {}, "finish_reason": "stop"}]}              final event
    {"choices": [], "usage": {...}}                                   final event, include_usage only

Completion streams (``text_completion``) are the same without the opening, with
``text`` instead of ``delta``. With ``include_usage`` every chunk carries
``"usage": null`` except the last, as OpenAI's do.

Tool calls (``record.tools``; the format and modes are in tools.py): with a named function
every text delta is an ``arguments`` delta of call 0 (its first delta carries ``id``, ``type``
and ``name``); with ``required`` or ``auto`` the text is held back once it may be a call
(``auto``: from a ``<tool_call>`` tag on; text before it streams as content) and the calls
come as one delta each (``index``, ``id``, ``type``, ``name``, whole ``arguments``) before
the final chunk, whose finish_reason is then ``tool_calls``.

``system_fingerprint`` names this server's version (OpenAI types it as a string);
a chat message's ``refusal`` is always null (nothing here refuses to answer).
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from services.gateway import tools
from services.gateway.request_record import CHAT, RequestRecord


def server_version() -> str:
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


SYSTEM_FINGERPRINT = f"pdserve-{server_version()}"


def response_id(record: RequestRecord) -> str:
    return ("chatcmpl-" if record.kind == CHAT else "cmpl-") + record.request_id


def usage(data: dict, record: RequestRecord, completion_tokens_seen: int) -> dict:
    """OpenAI usage from a final event's; an aborted request's may be empty, so fall back to what we know."""
    u = data.get("usage") or {}
    prompt = int(u.get("prompt_tokens", record.prompt_tokens))
    completion = int(u.get("completion_tokens", completion_tokens_seen))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": int(u.get("cached_prompt_tokens", 0))}}


def _chat_token(entry: dict) -> dict:
    token = entry.get("token", "")
    return {"token": token, "logprob": entry.get("logprob", 0.0), "bytes": list(token.encode("utf-8", "replace"))}


class LogprobsFormat:
    """A chunk's ``logprobs`` list in OpenAI's shape for chat or completions."""

    def __init__(self, kind: str, text_offset: int = 0):
        self.kind = kind
        self.text_offset = text_offset  # completions: characters of output before the next token

    def convert(self, entries: list[dict]) -> dict:
        if self.kind == CHAT:
            return {"content": [{**_chat_token(e), "top_logprobs": [_chat_token(t) for t in e.get("top") or []]}
                                for e in entries], "refusal": None}
        offsets = []
        for e in entries:
            offsets.append(self.text_offset)
            self.text_offset += len(e.get("token", ""))
        return {"tokens": [e.get("token", "") for e in entries],
                "token_logprobs": [e.get("logprob", 0.0) for e in entries],
                "top_logprobs": [{t.get("token", ""): t.get("logprob", 0.0) for t in e.get("top") or []}
                                 for e in entries],
                "text_offset": offsets}

    @staticmethod
    def merge(kind: str, parts: list[dict]) -> dict | None:
        if not parts:
            return None
        if kind == CHAT:
            return {"content": [c for p in parts for c in p["content"]], "refusal": None}
        return {key: [x for p in parts for x in p[key]]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def answered_by(record: RequestRecord, data: dict) -> None:
    """A ``model: "auto"`` request's events name the tier that answers (services/router/cascade.py): the
    response says that model from then on."""
    model = data.get("model")
    if model:
        record.model = model


class StreamFormatter:
    """One request's result events as OpenAI stream chunks (dicts), in order."""

    def __init__(self, record: RequestRecord, include_usage: bool, text_offset: int = 0):
        self.record = record
        self.include_usage = include_usage
        self.id = response_id(record)
        self.object = "chat.completion.chunk" if record.kind == CHAT else "text_completion"
        self.logprobs = LogprobsFormat(record.kind, text_offset) if record.logprobs is not None else None
        self.completion_tokens = 0
        self.tools = tools.ToolChoice.loads(record.tools) if record.kind == CHAT else None
        self.held = ""  # tool-call text not yet shown
        self.call_id = ""  # named function: the call's id once its first delta went out

    def _chunk(self, choices: list[dict], **extra: Any) -> dict:
        out = {"id": self.id, "object": self.object, "created": self.record.created, "model": self.record.model,
               "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices}
        if self.include_usage:
            out["usage"] = None
        out.update(extra)
        return out

    def _choice(self, text: str | None, finish_reason: str | None, logprobs: dict | None = None,
                role: bool = False) -> dict:
        if self.record.kind == CHAT:
            delta: dict = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}

    # the events of each step (responses.sse_events gives them their ids)
    done = True  # the stream ends with data: [DONE]

    def opening(self) -> list[dict]:
        """Chat's first chunk, the assistant role; sent only to a client that starts from the beginning."""
        return [self._chunk([self._choice(None, None, role=True)])] if self.record.kind == CHAT else []

    def chunk(self, data: dict) -> list[dict]:
        """A chunk event's chunk; none when it carries nothing to show (text held back, no logprobs)."""
        answered_by(self.record, data)
        self.completion_tokens += len(data.get("token_ids") or [])
        text = data.get("text") or ""
        entries = data.get("logprobs") or []
        logprobs = self.logprobs.convert(entries) if self.logprobs is not None and entries else None
        if self.tools is not None:
            return self._tool_chunk(text, logprobs)
        if not text and logprobs is None:
            return []
        return [self._chunk([self._choice(text, None, logprobs)])]

    def _tool_chunk(self, text: str, logprobs: dict | None) -> list[dict]:
        mode, _ = tools.mode_of(self.tools)
        if mode == tools.NAMED:
            if not text:
                return []
            call: dict = {"index": 0, "function": {"arguments": text}}
            if not self.call_id:
                self.call_id = tools.new_call_id()
                call = {"index": 0, "id": self.call_id, "type": "function",
                        "function": {"name": self.tools.name, "arguments": text}}
            return [self._chunk([{"index": 0, "delta": {"tool_calls": [call]}, "logprobs": logprobs,
                                  "finish_reason": None}])]
        self.held += text
        if mode == tools.AUTO:
            at = self.held.find(tools.OPEN_TAG)
            if at < 0:  # show all but what could be the start of a tag
                keep = next((k for k in range(len(tools.OPEN_TAG) - 1, 0, -1)
                             if self.held.endswith(tools.OPEN_TAG[:k])), 0)
                shown, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
            else:
                shown, self.held = self.held[:at].rstrip(), self.held[at:]
            if shown:
                return [self._chunk([self._choice(shown, None, logprobs)])]
        return []

    def _tool_final(self, reason: str) -> tuple[list[dict], str]:
        """The held-back calls (or text) at the end, and the finish reason."""
        mode, _ = tools.mode_of(self.tools)
        if mode == tools.NAMED:
            return [], "tool_calls" if reason == "stop" and self.call_id else reason
        content, calls = tools.parse_output(self.held, self.tools)
        out = []
        if content and not calls:
            out.append(self._chunk([self._choice(content, None)]))
        for i, call in enumerate(calls):
            delta = {"tool_calls": [{"index": i, "id": tools.new_call_id(), "type": "function",
                                     "function": {"name": call["name"], "arguments": call["arguments"]}}]}
            out.append(self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]))
        return out, "tool_calls" if calls and reason == "stop" else reason

    def final(self, data: dict) -> list[dict]:
        answered_by(self.record, data)
        reason = data.get("finish_reason") or "stop"
        out = []
        if self.tools is not None:
            out, reason = self._tool_final(reason)
        out += [self._chunk([self._choice(None if self.record.kind == CHAT else "", reason)])]
        if self.include_usage:
            out.append(self._chunk([], usage=usage(data, self.record, self.completion_tokens)))
        return out

    @staticmethod
    def failure(body: dict) -> list[dict]:
        """An error after the status line was sent: the OpenAI error object as an event."""
        return [body]

    @staticmethod
    def event_name(_payload: dict) -> str | None:
        return None


class ResponseAggregate:
    """One request's result events as a single non-stream response body."""

    def __init__(self, record: RequestRecord):
        self.record = record
        self.text: list[str] = []
        self.logprobs_parts: list[dict] = []
        self.logprobs = LogprobsFormat(record.kind) if record.logprobs is not None else None
        self.completion_tokens = 0

    def add(self, data: dict) -> None:
        answered_by(self.record, data)
        self.completion_tokens += len(data.get("token_ids") or [])
        self.text.append(data.get("text") or "")
        if self.logprobs is not None and data.get("logprobs"):
            self.logprobs_parts.append(self.logprobs.convert(data["logprobs"]))

    def body(self, final: dict) -> dict:
        answered_by(self.record, final)
        rec, text = self.record, "".join(self.text)
        logprobs = LogprobsFormat.merge(rec.kind, self.logprobs_parts) if self.logprobs is not None else None
        reason = final.get("finish_reason") or "stop"
        if rec.kind == CHAT:
            message = {"role": "assistant", "content": text, "refusal": None}
            choice_tools = tools.ToolChoice.loads(rec.tools)
            if choice_tools is not None:
                content, calls = tools.parse_output(text, choice_tools)
                if calls:
                    message["content"] = content
                    message["tool_calls"] = [{"id": tools.new_call_id(), "type": "function", "function": c}
                                             for c in calls]
                    reason = "tool_calls" if reason == "stop" else reason
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
            obj = "text_completion"
        return {"id": response_id(rec), "object": obj, "created": rec.created, "model": rec.model,
                "system_fingerprint": SYSTEM_FINGERPRINT, "choices": [choice],
                "usage": usage(final, rec, self.completion_tokens)}
