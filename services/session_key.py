"""The session-affinity key a client sends (``prompt_cache_key``, ``X-Session-ID``, gRPC ``session_key``).

A routing hint only: requests with the same key go to the same worker while it
is healthy and not overloaded (``services/router/affinity.py``). It never
changes the output. Validated once here, by every edge that takes one and by
the queue message that carries it to the router, so a key the gateway accepted
is one the router accepts.
"""

from __future__ import annotations

from typing import Any

from services.errors import InvalidRequestError

# OpenAI documents no limit; a key is hashed, never stored per session, but it travels in every
# queue entry and a header, so it is kept short (UUIDs, "user-123:conv-456" and SHA-256 hex fit).
MAX_BYTES = 256


def validate_session_key(value: Any, param: str = "prompt_cache_key") -> str:
    """The key as a str ("" for none: absent, null or empty); a 400 naming ``param`` otherwise."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidRequestError(f"{param} must be a string, got {type(value).__name__}", param=param)
    size = len(value.encode("utf-8", errors="surrogatepass"))
    if size > MAX_BYTES:
        raise InvalidRequestError(f"{param} is {size} bytes long; the limit is {MAX_BYTES} bytes of UTF-8",
                                  param=param)
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise InvalidRequestError(f"{param} must not contain control characters", param=param)
    return value


HEADER = "x-session-id"  # the HTTP header and gRPC metadata key, for clients that cannot set the field


def session_key_of(field: Any, header: str | None, param: str = "prompt_cache_key") -> str:
    """The request's key: its body or message field when set, else the ``X-Session-ID`` header."""
    key = validate_session_key(field, param)
    return key or validate_session_key(header or None, "X-Session-ID")
