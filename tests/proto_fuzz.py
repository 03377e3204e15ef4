"""Random and mutated protobuf messages for fuzzing gRPC servers, drawn from the protos' descriptors.

``messages(descriptor)``: a hypothesis strategy of serialized messages with any subset of
their fields set, nested messages to a small depth, extreme and out-of-range numbers,
unknown enum values, long strings and long repeated fields. ``invalid_utf8(descriptor)``:
wire bytes whose string fields hold bytes that are not UTF-8 (which the Python protobuf
API refuses to build, but a client in another language or a broken one can send).
``mutated(data)``: a valid message's bytes flipped, truncated, spliced or extended.
``raw_call``: sends bytes as they are and returns the status code a client sees.
"""

from __future__ import annotations

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import strategies as st

_INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1), F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1), F.TYPE_SINT64: (-(2**63), 2**63 - 1), F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}


def _ints(lo: int, hi: int):
    edges = [lo, hi, 0, 1, -1, 2**31 - 1, 2**31, 2**53]
    return st.one_of(st.sampled_from([e for e in edges if lo <= e <= hi]), st.integers(lo, hi))


def _scalar(field):
    t = field.type
    if t in _INT_RANGES:
        return _ints(*_INT_RANGES[t])
    if t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return st.floats(allow_nan=True, allow_infinity=True, width=32 if t == F.TYPE_FLOAT else 64)
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        return st.one_of(st.text(max_size=40), st.sampled_from(["", "x" * 70_000, "\x00", "\u202e\ud7ff"]))
    if t == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == F.TYPE_ENUM:  # open enums: unknown numbers travel as they are
        return st.integers(-3, 1000)
    raise TypeError(f"no strategy for field type {t}")


def _message(desc, depth: int):
    fields = {}
    for field in desc.fields:
        if field.type == F.TYPE_GROUP or (field.type == F.TYPE_MESSAGE and depth >= 3):
            continue
        if field.type == F.TYPE_MESSAGE:
            if field.message_type.GetOptions().map_entry:
                continue
            value = st.deferred(lambda f=field: _message(f.message_type, depth + 1))
        else:
            value = _scalar(field)
        if field.is_repeated:
            long = st.integers(50_000, 200_000).map(lambda n: [0] * n) if field.type in _INT_RANGES else st.nothing()
            value = st.one_of(st.lists(value, max_size=4), long)
        fields[field.name] = st.none() | value
    cls = message_factory.GetMessageClass(desc)

    def build(values: dict):
        msg = cls()
        for name, value in values.items():
            if value is None:
                continue
            field = desc.fields_by_name[name]
            if field.is_repeated:
                getattr(msg, name).extend(value)
            elif field.type == F.TYPE_MESSAGE:
                getattr(msg, name).CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg

    return st.fixed_dictionaries(fields).map(build)


def messages(desc):
    """Serialized messages of type ``desc`` (a Descriptor)."""
    return _message(desc, 0).map(lambda m: m.SerializeToString())


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def invalid_utf8(desc) -> list[bytes]:
    """One message per string field (top level and one level down) holding bytes that are not UTF-8."""
    bad = b"\xff\xfe\xc3\x28"
    out = []
    for field in desc.fields:
        if field.type == F.TYPE_STRING:
            out.append(_varint(field.number << 3 | 2) + _varint(len(bad)) + bad)
        elif field.type == F.TYPE_MESSAGE and not field.message_type.GetOptions().map_entry:
            for inner in invalid_utf8_fields(field.message_type, bad):
                out.append(_varint(field.number << 3 | 2) + _varint(len(inner)) + inner)
    return out


def invalid_utf8_fields(desc, bad: bytes) -> list[bytes]:
    return [_varint(f.number << 3 | 2) + _varint(len(bad)) + bad for f in desc.fields if f.type == F.TYPE_STRING]


def mutated(data: bytes):
    """A strategy of ``data`` damaged: a byte flipped, cut short, a run inserted or repeated."""
    n = max(1, len(data))
    flip = st.tuples(st.integers(0, n - 1), st.integers(1, 255)).map(
        lambda p: data[: p[0]] + bytes([(data[p[0]] if data else 0) ^ p[1]]) + data[p[0] + 1:])
    cut = st.integers(0, n - 1).map(lambda i: data[:i])
    insert = st.tuples(st.integers(0, n), st.binary(min_size=1, max_size=16)).map(
        lambda p: data[: p[0]] + p[1] + data[p[0]:])
    return st.one_of(flip, cut, insert, st.just(data * 3), st.binary(max_size=128))


def raw_call(channel: grpc.Channel, method: str, data: bytes, streaming: bool, metadata=(), timeout: float = 15.0,
             client_streaming: bool = False):
    """Send ``data`` as the request of ``method`` ('/pkg.Service/Name'; ``client_streaming``: as the one
    message of a request stream); the status code and details the client sees."""
    try:
        if client_streaming:
            channel.stream_unary(method)(iter([data]), metadata=metadata, timeout=timeout)
        elif streaming:
            for _ in channel.unary_stream(method)(data, metadata=metadata, timeout=timeout):
                pass
        else:
            channel.unary_unary(method)(data, metadata=metadata, timeout=timeout)
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""
