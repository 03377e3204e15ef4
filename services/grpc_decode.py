"""Servicers whose requests are decoded by pdserve, so a malformed message is INVALID_ARGUMENT.

grpc decodes a request with the generated ``FromString`` before the servicer runs,
and a message that does not parse (cut short, a flipped byte, a string field that
is not UTF-8) then reaches the client as UNKNOWN with the parser's exception text,
and the server logs an error for it. ``add_servicer`` registers the same
handlers as the generated ``add_*Servicer_to_server`` function, with the bytes
passed through and decoded in the handler instead, where a ``DecodeError`` becomes
INVALID_ARGUMENT naming the message type, like any other bad input.
"""

from __future__ import annotations

import inspect
from typing import Callable

import grpc
from google.protobuf.message import DecodeError


class _Capture:
    """Stands in for the server while a generated ``add_*_to_server`` function registers its handlers."""

    def __init__(self):
        self.services: dict[str, dict[str, grpc.RpcMethodHandler]] = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # the same handlers arrive through add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.services[service] = handlers


async def _decode(raw: bytes, parse: Callable, context: grpc.aio.ServicerContext):
    try:
        return parse(raw)
    except DecodeError as e:
        what = getattr(parse, "__self__", None)
        name = what.DESCRIPTOR.full_name if what is not None else "protobuf"
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid {name} message: {e}")


async def _decoded(requests, parse: Callable, context):
    async for raw in requests:
        yield await _decode(raw, parse, context)


def _wrap(behavior: Callable, parse: Callable, streaming_request: bool) -> Callable:
    def request(arg, context):
        return _decoded(arg, parse, context) if streaming_request else _decode(arg, parse, context)

    async def _one(arg, context):
        return arg if streaming_request else await arg

    if inspect.isasyncgenfunction(behavior):
        async def stream(arg, context):
            async for reply in behavior(await _one(request(arg, context), context), context):
                yield reply
        return stream

    async def call(arg, context):
        return await behavior(await _one(request(arg, context), context), context)
    return call


def add_servicer(server: grpc.aio.Server, servicer, add_to_server: Callable) -> list[str]:
    """``add_to_server(servicer, server)`` (a generated function), with requests decoded in the
    handlers; returns the names of the services added."""
    capture = _Capture()
    add_to_server(servicer, capture)
    for service, handlers in capture.services.items():
        safe = {}
        for name, h in handlers.items():
            kind = "stream" if h.request_streaming else "unary"
            kind += "_stream" if h.response_streaming else "_unary"
            behavior = getattr(h, kind)
            safe[name] = h._replace(request_deserializer=None,
                                    **{kind: _wrap(behavior, h.request_deserializer, h.request_streaming)})
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, safe),))
        server.add_registered_method_handlers(service, safe)
    return list(capture.services)
