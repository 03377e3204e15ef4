"""One queued request as it travels on a priority stream: what the router needs to run it.

A stream entry is a flat map of strings. ``to_fields`` writes one and
``from_fields`` reads one back (bytes or str keys and values, as redis-py
returns them with or without ``decode_responses``). Everything is validated on
the way in and on the way out: a malformed entry (written by something other
than ``AdmissionQueue``, or by a newer schema) raises ``InvalidRequestError``,
which the consumer turns into a dead letter instead of crashing on it.

Fields (schema ``v`` = 1)::

    request_id   [A-Za-z0-9._:-]{1,128}; also names the result stream and state key
    tenant       who pays; may be ""
    tier         priority tier (one of QueueConfig.tiers, checked at enqueue)
    model        the base model whose workers serve it ("auto": the cascade's first tier; "": any)
    token_ids    JSON list of ints >= 0, not empty (the templated, tokenized prompt)
    sampling     JSON object of sampling parameters; the router builds SamplingParams from it
    deadline     unix seconds as a float; 0 = none
    traceparent  W3C trace context, may be ""
    enqueued_at  unix seconds as a float (queue-wait metric, deadline bookkeeping)
    session_key  optional: the client's session-affinity key (services/session_key.py); absent = none
    cascade      optional: ``model: "auto"``'s tiers and signal, JSON (services/cascade.py); absent = none
    choices      optional: n > 1 (or best_of's candidates), as one forked generation; absent = 1.
                 Choice 0 is ``request_id`` with ``sampling``; choice i has its own request id and
                 result stream, ``choice_id(request_id, i)``, and ``choice_sampling(sampling, i)``
                 (seed + i)

Unknown fields are ignored, so the queue can add delivery metadata
(``attempts``, ``last_error``, ``last_worker``) beside them.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.errors import InvalidRequestError
from services.session_key import validate_session_key

SCHEMA_VERSION = "1"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_CHOICES = 128
_INT64 = 1 << 64
_FIELDS = ("request_id", "tenant", "tier", "model", "token_ids", "sampling", "deadline", "traceparent",
           "enqueued_at")


def text(value: Any) -> str:
    """A Redis reply value as str (redis-py gives bytes unless decode_responses is set)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="backslashreplace")
    return str(value)


def text_fields(fields: Mapping) -> dict[str, str]:
    return {text(k): text(v) for k, v in fields.items()}


@dataclass
class QueuedRequest:
    request_id: str
    tenant: str
    tier: str
    model: str
    token_ids: list[int]
    sampling: dict = field(default_factory=dict)
    deadline: float = 0.0  # unix seconds; 0 = none
    traceparent: str = ""
    enqueued_at: float = field(default_factory=time.time)
    session_key: str = ""  # "" for none; a routing hint (services/router/affinity.py)
    cascade: str = ""  # "" for none; else CascadeSpec.to_json() (services/cascade.py)
    choices: int = 1  # n > 1: one forked generation of that many choices (choice_id, choice_sampling)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not _REQUEST_ID.fullmatch(self.request_id):
            raise InvalidRequestError(
                f"request_id must be 1-128 characters of [A-Za-z0-9._:-]; got {self.request_id!r}",
                param="request_id")
        for name in ("tenant", "tier", "model", "traceparent", "cascade"):
            if not isinstance(getattr(self, name), str):
                raise InvalidRequestError(f"{name} must be a string", param=name)
        if not self.tier:
            raise InvalidRequestError("tier is empty", param="tier")
        if (not isinstance(self.token_ids, list) or not self.token_ids
                or not all(type(t) is int and t >= 0 for t in self.token_ids)):
            raise InvalidRequestError("token_ids must be a non-empty list of non-negative ints", param="token_ids")
        if not isinstance(self.sampling, dict):
            raise InvalidRequestError("sampling must be a JSON object", param="sampling")
        for name in ("deadline", "enqueued_at"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise InvalidRequestError(f"{name} must be a finite number >= 0", param=name)
            setattr(self, name, float(value))
        self.session_key = validate_session_key(self.session_key, "session_key")
        if type(self.choices) is not int or not 1 <= self.choices <= MAX_CHOICES:
            raise InvalidRequestError(f"choices must be an integer in [1, {MAX_CHOICES}]", param="choices")
        if self.choices > 1 and len(choice_id(self.request_id, self.choices - 1)) > 128:
            raise InvalidRequestError("request_id is too long for its choices' ids", param="request_id")

    @property
    def choice_ids(self) -> list[str]:
        """Every choice's request id (and result stream), choice 0's first."""
        return [choice_id(self.request_id, i) for i in range(self.choices)]

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)

    def expired(self, now: float | None = None) -> bool:
        return self.deadline > 0 and (time.time() if now is None else now) >= self.deadline

    def to_fields(self) -> dict[str, str]:
        return {
            "v": SCHEMA_VERSION,
            "request_id": self.request_id,
            "tenant": self.tenant,
            "tier": self.tier,
            "model": self.model,
            "token_ids": json.dumps(self.token_ids, separators=(",", ":")),
            "sampling": json.dumps(self.sampling, separators=(",", ":")),
            "deadline": repr(self.deadline),
            "traceparent": self.traceparent,
            "enqueued_at": repr(self.enqueued_at),
            # written only when set: entries without a key stay as they were, and read back the same
            **({"session_key": self.session_key} if self.session_key else {}),
            **({"cascade": self.cascade} if self.cascade else {}),
            **({"choices": str(self.choices)} if self.choices > 1 else {}),
        }

    @classmethod
    def from_fields(cls, fields: Mapping) -> QueuedRequest:
        """Parse a stream entry; ``InvalidRequestError`` names what is wrong with a malformed one."""
        f = text_fields(fields)
        version = f.get("v")
        if version != SCHEMA_VERSION:
            raise InvalidRequestError(f"queue entry has schema version {version!r}, expected {SCHEMA_VERSION!r}")
        missing = [name for name in _FIELDS if name not in f]
        if missing:
            raise InvalidRequestError(f"queue entry is missing fields {missing}")
        try:
            token_ids = json.loads(f["token_ids"])
            sampling = json.loads(f["sampling"])
        except ValueError as exc:
            raise InvalidRequestError(f"queue entry has invalid JSON: {exc}") from None
        try:
            deadline, enqueued_at = float(f["deadline"]), float(f["enqueued_at"])
            choices = int(f.get("choices", "1"))
        except ValueError:
            raise InvalidRequestError("queue entry has a non-numeric deadline, enqueued_at or choices") from None
        return cls(request_id=f["request_id"], tenant=f["tenant"], tier=f["tier"], model=f["model"],
                   token_ids=token_ids, sampling=sampling, deadline=deadline, traceparent=f["traceparent"],
                   enqueued_at=enqueued_at, session_key=f.get("session_key", ""), cascade=f.get("cascade", ""),
                   choices=choices)


def choice_id(request_id: str, i: int) -> str:
    """Choice i's request id: the request's own for choice 0, ``<id>-<i>`` for the others (in the same gateway's
    delivery slot, keys.py; an attempt's worker id appends ``.<attempt>`` to it, dispatch.py)."""
    return request_id if i == 0 else f"{request_id}-{i}"


def choice_sampling(sampling: dict, i: int) -> dict:
    """Choice i's sampling parameters: the request's, with seed + i (wrapped into int64) when it has a seed, as
    vLLM V1 seeds its choices."""
    out = dict(sampling)
    if out.get("seed") is not None and i:
        out["seed"] = choice_seed(out["seed"], i)
    return out


def choice_seed(seed: int, i: int) -> int:
    """Choice i's seed: seed + i, wrapped into int64."""
    return (seed + i + (1 << 63)) % _INT64 - (1 << 63)
