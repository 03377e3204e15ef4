"""Bad input gets a 4xx with an OpenAI error object naming the problem; never a 5xx, never a queue entry."""

from __future__ import annotations

import json

import httpx
import pytest

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "Hi"}]

# (path, body: a dict (sent as JSON) or raw bytes, status, param the error must name (None: don't check))
CASES = [
    (CHAT, b'{"messages": [', 400, None),  # malformed JSON
    (CHAT, b"", 400, None),
    (CHAT, b"[1, 2]", 400, None),  # not an object
    (CHAT, b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}', 400, None),
    (CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),  # invalid UTF-8
    (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, None),  # lone surrogate
    (CHAT, b"[" * 100_000, 400, None),  # nested too deeply
    (CHAT, {}, 400, "messages"),  # missing field
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "Hi"}, 400, "messages"),
    (CHAT, {"messages": ["Hi"]}, 400, "messages[0]"),
    (CHAT, {"messages": [{"role": "robot", "content": "Hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": {"name": "user"}, "content": "Hi"}]}, 400, "messages[0].role"),  # was a 500
    (CHAT, {"messages": [{"role": ["user"], "content": "Hi"}]}, 400, "messages[0].role"),
    ("/tokenize", {"messages": [{"role": {}, "content": "Hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0]"),
    (CHAT, {"messages": MSG, "max_tokens": "5"}, 400, "max_tokens"),  # wrong types
    (CHAT, {"messages": MSG, "max_tokens": 5.5}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "temperature": "hot"}, 400, "temperature"),
    (CHAT, {"messages": MSG, "temperature": True}, 400, "temperature"),
    (CHAT, {"messages": MSG, "stream": "yes"}, 400, "stream"),
    (CHAT, {"messages": MSG, "stop": 5}, 400, "stop"),
    (CHAT, {"messages": MSG, "stop": ["ok", 5]}, 400, "stop"),
    (CHAT, {"messages": MSG, "model": 3}, 400, "model"),
    (CHAT, {"messages": MSG, "seed": 2 ** 70}, 400, "seed"),
    (CHAT, {"messages": MSG, "max_tokens": -1}, 400, "max_tokens"),  # out of range
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "temperature": -0.5}, 400, "temperature"),
    (CHAT, {"messages": MSG, "top_p": 1.5}, 400, "top_p"),
    (CHAT, {"messages": MSG, "presence_penalty": 3}, 400, "presence_penalty"),
    (CHAT, {"messages": MSG, "n": 0}, 400, "n"),
    (CHAT, {"messages": MSG, "n": 9}, 400, "n"),  # above the documented cap (protocol.MAX_N)
    (CHAT, {"messages": MSG, "n": "2"}, 400, "n"),
    (CHAT, {"messages": MSG, "logit_bias": {"5": 101}}, 400, "logit_bias"),  # bias out of range
    (CHAT, {"messages": MSG, "logit_bias": {"5": "up"}}, 400, "logit_bias"),
    (CHAT, {"messages": MSG, "logit_bias": {"dog": 1}}, 400, "logit_bias"),  # not a token id
    (CHAT, {"messages": MSG, "logit_bias": {"-3": 1}}, 400, "logit_bias"),
    (CHAT, {"messages": MSG, "logit_bias": {"99999999": 1}}, 400, "logit_bias"),  # outside the vocabulary
    (CHAT, {"messages": MSG, "logit_bias": [5]}, 400, "logit_bias"),
    (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"5": -100.5}}, 400, "logit_bias"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (CHAT, {"messages": MSG, "tools": {"type": "function", "function": {"name": "f"}}}, 400, "tools"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {}}]}, 400, "tools[0].function.name"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}]}, 400, "tools[0].function.parameters"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    (CHAT, {"messages": MSG, "tool_choice": "required"}, 400, "tool_choice"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frob"}}}}, 400, "response_format"),
    (CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    (CHAT, {"messages": MSG, "model": "gpt-4o"}, 404, "model"),  # unknown model
    (CHAT, {"messages": [{"role": "user", "content": "word " * 400}]}, 400, None),  # prompt over context
    (CHAT, {"messages": MSG, "max_tokens": 500}, 400, "max_tokens"),  # prompt + output over context
    (COMPLETIONS, {}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    (COMPLETIONS, {"prompt": 5}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [1, -2]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [10 ** 9]}, 400, "prompt"),  # outside the vocabulary
    (COMPLETIONS, {"prompt": "Hi", "logprobs": 30}, 400, "logprobs"),
    (COMPLETIONS, {"prompt": "Hi", "echo": True}, 400, "echo"),
    (COMPLETIONS, {"prompt": "Hi", "n": 3, "best_of": 2}, 400, "best_of"),  # fewer candidates than choices
    (COMPLETIONS, {"prompt": "Hi", "best_of": 9}, 400, "best_of"),
    (COMPLETIONS, {"prompt": "Hi", "best_of": 2, "stream": True}, 400, "best_of"),
    (COMPLETIONS, {"prompt": "Hi", "n": 9, "best_of": 9}, 400, "n"),
    ("/tokenize", {}, 400, None),
    ("/tokenize", {"messages": "Hi"}, 400, "messages"),
]


def _send(http: httpx.Client, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(path, content=content, headers={"content-type": "application/json"})


def test_bad_input_is_a_4xx_with_an_openai_error(gateway):
    h = gateway(model_len=300)
    problems = []
    with httpx.Client(base_url=h.url, timeout=10) as http:
        for path, body, status, param in CASES:
            r = _send(http, path, body)
            what = f"{path} {body if isinstance(body, dict) else body[:60]!r}"
            try:
                error = r.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["message"], r.text
                assert r.status_code == status, r.text
                assert param is None or error["param"] == param, r.text
            except (AssertionError, ValueError, KeyError) as exc:
                problems.append(f"{what} -> {r.status_code}: {exc}")
    assert not problems, "\n".join(problems)
    assert h.router.seen == []


def test_context_length_error_code(gateway):
    h = gateway(model_len=300)
    with httpx.Client(base_url=h.url, timeout=10) as http:
        for prompt, max_tokens in ((300, 1), (299, 2)):
            r = http.post(COMPLETIONS, json={"prompt": [7] * prompt, "max_tokens": max_tokens})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert http.post(COMPLETIONS, json={"prompt": [7] * 299, "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("chunked", [False, True])
def test_huge_body_is_413_before_parsing(gateway, chunked):
    h = gateway(max_body_bytes=64 * 1024)
    body = json.dumps({"prompt": "x" * 200_000}).encode()
    with httpx.Client(base_url=h.url, timeout=10) as http:
        if chunked:  # no Content-Length: the bytes are counted as they arrive
            r = http.post(COMPLETIONS, content=(body[i:i + 8192] for i in range(0, len(body), 8192)))
        else:
            r = http.post(COMPLETIONS, content=body)
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large"
        # a body under the limit is fine
        assert http.post(COMPLETIONS, json={"prompt": "x" * 1000, "max_tokens": 2}).status_code == 200


def test_unknown_routes_and_methods_answer_openai_errors(gateway):
    h = gateway()
    with httpx.Client(base_url=h.url, timeout=10) as http:
        r = http.get("/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()
        r = http.get(CHAT)
        assert r.status_code == 405 and "error" in r.json()


def _raw_exchange(sock, request: bytes) -> bytes:
    """Send one HTTP/1.1 request on an open socket and read one whole response (Content-Length bodies)."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def _post(path: str, body: dict) -> bytes:
    raw = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n").encode() + raw


def test_keep_alive_connection_survives_an_unexpected_error(gateway, monkeypatch):
    """A 500 used to close the connection under the client: its next request on it met a reset."""
    import socket

    h = gateway()

    def broken(*_args, **_kwargs):
        raise TypeError("a bug")

    monkeypatch.setattr(h.core, "resolve_tier", broken)
    with socket.create_connection(("127.0.0.1", h.port), timeout=10) as sock:
        reply = _raw_exchange(sock, _post(COMPLETIONS, {"prompt": "Hi", "max_tokens": 2}))
        assert reply.startswith(b"HTTP/1.1 500"), reply[:200]
        error = json.loads(reply.partition(b"\r\n\r\n")[2])["error"]
        assert error["type"] == "internal_error" and "a bug" not in error["message"]
        monkeypatch.undo()
        # the same connection serves the next request
        reply = _raw_exchange(sock, _post(CHAT, {"messages": [{"role": "user", "content": "Hi"}]}))
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
        # and after a 400 too
        reply = _raw_exchange(sock, _post(CHAT, {"messages": [{"role": ["user"], "content": "Hi"}]}))
        assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
        reply = _raw_exchange(sock, _post(CHAT, {"messages": [{"role": "user", "content": "Hi"}]}))
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_slow_oversized_upload_reads_its_413_on_a_live_connection(gateway, chunked):
    """A client still uploading megabytes past the limit used to meet a reset connection instead
    of the 413 (the gateway answered and closed with unread bytes; the kernel's reset then threw
    the answer away): the gateway reads the rest of the body, drops it, answers, and keeps the
    connection."""
    import socket
    import time

    h = gateway(max_body_bytes=64 * 1024)
    total, piece = 4 << 20, 1 << 16
    framing = b"Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}".encode()
    with socket.create_connection(("127.0.0.1", h.port), timeout=20) as sock:
        sock.sendall(b"POST " + COMPLETIONS.encode() + b" HTTP/1.1\r\nHost: test\r\n"
                     b"Content-Type: application/json\r\n" + framing + b"\r\n\r\n")
        for i in range(total // piece):
            data = b"x" * piece
            sock.sendall(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            if i == 16:
                time.sleep(0.5)  # the gateway has seen the limit crossed by now
        if chunked:
            sock.sendall(b"0\r\n\r\n")
        reply = _raw_exchange(sock, b"")
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_too_large"
        # the same connection serves the next request
        reply = _raw_exchange(sock, _post(COMPLETIONS, {"prompt": "Hi", "max_tokens": 2}))
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
