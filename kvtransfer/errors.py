"""kvtransfer's one error: moving KV blocks between processes failed.

kvtransfer imports nothing from ``services`` (tests/test_layering.py), so this is not a
``services.errors.PdserveError``; it carries the same three attributes, and pdserve's edges
(``services.grpc_codec.status_of``, the CLI) answer it from them like any pdserve error: a
worker whose transfer failed answers UNAVAILABLE, and the router retries elsewhere.
"""

from __future__ import annotations


class TransferError(Exception):
    """Peer gone, timeout, incompatible peer, malformed descriptor, a transport failure."""

    code = "kv_transfer_error"
    http_status = 502
    grpc_status = "UNAVAILABLE"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class SendAbandoned(TransferError):
    """The sender gave up on a message part-way through its payload (its send was cancelled:
    the request was aborted, or its client left) and said so on the wire. Only that message's
    transfer fails: the connection is still in step and carries the other transfers on
    (``tcp.py``; UCX closes its connection instead)."""
