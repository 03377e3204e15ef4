"""The block-level protocol between a sender (prefill) and a receiver (decode).

Every message is a JSON header, optionally followed by payload buffers (the
KV bytes of one run of adjacent blocks each, see ``block_runs.py``). A
connection carries any number of transfers, interleaved::

    sender (prefill)                               receiver (decode)
                                                   reserve(tid, n) -> descriptor
    connect(descriptor.address)
      hello {peer}                       ------>   compatibility check
                                         <------   welcome {peer} | refused {error}
    send_blocks(desc, src, dst_offset)   (once per prefill chunk, as it finishes)
      blocks {tid, runs} + run payloads  ------>   written straight into the reserved blocks
                                         <------   failed {tid, error}   (only if rejected)
    finish(desc, first_token)
      finish {tid, first_token, meta}    ------>   all blocks written? -> pending resolves
                                         <------   done {tid} | failed {tid, error}
    finish(desc, first_token, blocks=last chunk's, dst_offset)
      blocks {tid, runs, finish: {first_token, meta}} + payloads
                                         ------>   written, then as finish above
    abort(desc, reason)
      abort {tid, reason}                ------>   pending fails, blocks released

The receiver also sends ``failed`` on its own when a transfer times out or is
cancelled, so a sender learns of it before its next chunk. After
``refused`` the receiver reads only ``abort`` messages (so the transfer that
prompted the connection fails at once with the compatibility error on the
receiver side too), then closes.

Framing keys added by the transports start with ``_`` (``_payload``: byte size
of each payload buffer; ``_tags``: UCX tags) and are not part of the protocol.
"""

from __future__ import annotations

import json
import struct

HELLO = "hello"
WELCOME = "welcome"
REFUSED = "refused"
BLOCKS = "blocks"
FINISH = "finish"
ABORT = "abort"
DONE = "done"
FAILED = "failed"

# Control headers stay small (the runs of one chunk); the cap bounds the
# receive buffer a UCX connection keeps posted. 2048 single-block runs (a fully
# fragmented 32k-token prompt) encode to about 40 KiB.
MAX_HEADER_BYTES = 1 << 20
_LEN = struct.Struct("<I")


def encode_header(header: dict) -> bytes:
    body = json.dumps(header, separators=(",", ":")).encode()
    if len(body) + _LEN.size > MAX_HEADER_BYTES:
        raise ValueError(f"message header of {len(body)} bytes exceeds {MAX_HEADER_BYTES}")
    return _LEN.pack(len(body)) + body


def header_length(prefix: bytes | memoryview) -> int:
    (n,) = _LEN.unpack(bytes(prefix[: _LEN.size]))
    if n + _LEN.size > MAX_HEADER_BYTES:
        raise ValueError(f"message header of {n} bytes exceeds {MAX_HEADER_BYTES}")
    return n


PREFIX_BYTES = _LEN.size


def decode_body(body: bytes | memoryview) -> dict:
    header = json.loads(bytes(body))
    if not isinstance(header, dict) or "type" not in header:
        raise ValueError(f"malformed message header {header!r}")
    return header


def payload_sizes(header: dict) -> list[int]:
    return list(header.get("_payload", ()))
