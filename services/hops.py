"""Where a request's first token waits: one timestamp per hop, per request, in every process.

Off unless ``PDSERVE_HOPS_DIR`` names a directory (``pdserve bench hops`` and the
acceptance test set it for the stack they start). Then ``mark(request_id, hop)``
appends one JSON line ``{"rid", "hop", "t", ...}`` to ``<dir>/<pid>.jsonl``; off,
it is one global lookup. The hops of a cached request's first token, in order::

    gateway  gw.arrive      the HTTP handler began (before parsing)
             gw.enqueue     admitted (tokenized, limits checked): the queue write begins
             gw.queued      the record and the queue entry are written (one round trip; beside the path:
                            the router can read the entry before the reply reaches the gateway)
    router   router.read    the consumer's read returned the entry
             router.placed  the workers are chosen (route decision)
             router.sent    the first worker call is issued (Decode, or Prefill + Reserve)
    prefill  prefill.recv   its Prefill handler took the request       (disaggregated only)
             prefill.done   the prompt is computed and its KV sent (beside the path: the call returns
                            once the sender heard the KV landed, after decode.kv)
    decode   decode.recv    its Decode handler took the request (beside the path when a prefill worker
                            computes: the Decode call is made while it does)
             decode.added   the engine thread took it in, between two steps (a Decode that computes its own
                            prompt, as a cached one does; its ``step`` is the steps run so far; a prefill
                            worker marks ``prefill.added`` the same way, off the path)
             decode.kv      the KV of a prefill worker arrived                  (disaggregated only)
             (decode.reserve: its Reserve handler took the request; disaggregated only, beside the path)
             decode.token   the engine step that made the first token ended (engine thread)
             decode.written the chunk of that token is in Redis (the step's pipeline returned)
    gateway  gw.delivered   the delivery reader handed the first chunk to the request
             gw.sse         the first content event was handed to the HTTP server

Times are ``time.time_ns()``: on one host every process reads the same
CLOCK_REALTIME, so the marks of different processes compare directly (a
multi-host stack would need the offsets ``pdserve profile`` measures). The
worker marks carry the engine's step counter (``step``): the acceptance test
counts the engine steps between a request reaching the decode worker and its
first token from them, not from wall time.
"""

from __future__ import annotations

import json
import os
import threading
import time

ENV = "PDSERVE_HOPS_DIR"
FIRST_TOKEN_HOPS = ("gw.arrive", "gw.enqueue", "gw.queued", "router.read", "router.placed", "router.sent",
                    "prefill.recv", "prefill.done", "decode.recv", "decode.added", "decode.kv", "decode.token",
                    "decode.written", "gw.delivered", "gw.sse")
# Marks that happen beside the first token's path, not on it: the gateway's queue write returns while
# the router may already read the entry; a disaggregated request's Decode call reaches the decode
# worker while the prefill computes, and the prefill call returns once the sender heard the KV
# landed. Each is timed from the mark given here instead.
SIDE_HOPS = {"gw.queued": "gw.enqueue", "decode.recv": "router.sent", "prefill.done": "prefill.recv"}


def first_token_path(marks: dict) -> list[tuple[str, str]]:
    """The (from, to) hops of one request's first token, in causal order, then its side hops."""
    on_path = [h for h in FIRST_TOKEN_HOPS if h in marks
               and not (h in ("gw.queued", "prefill.done") or (h == "decode.recv" and "prefill.recv" in marks))]
    pairs = list(zip(on_path, on_path[1:]))
    pairs += [(before, side) for side, before in SIDE_HOPS.items()
              if side in marks and before in marks and side not in on_path]
    return pairs

_dir = os.environ.get(ENV) or None
_lock = threading.Lock()
_file = None


def enabled() -> bool:
    return _dir is not None


def mark(request_id: str, hop: str, **extra) -> None:
    """Record that ``request_id`` passed ``hop`` now (no-op unless PDSERVE_HOPS_DIR is set)."""
    if _dir is None:
        return
    record = {"rid": request_id, "hop": hop, "t": time.time_ns(), **extra}
    line = json.dumps(record, separators=(",", ":")) + "\n"
    global _file
    with _lock:
        if _file is None:
            _file = open(os.path.join(_dir, f"{os.getpid()}.jsonl"), "a", buffering=1)
        _file.write(line)


def client_id(worker_request_id: str) -> str:
    """The client's request id of a worker request id (``<id>.<attempt>``, dispatch.py)."""
    head, _, attempt = worker_request_id.rpartition(".")
    return head if head and attempt.isdigit() else worker_request_id


def read(directory: str) -> dict[str, dict[str, dict]]:
    """Every process's marks in ``directory``: request id -> hop -> its first record, with ``n``: how many
    times the request passed the hop (a worker call made twice, a retry)."""
    out: dict[str, dict[str, dict]] = {}
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".jsonl"):
            continue
        with open(os.path.join(directory, name)) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:  # a process killed mid-line
                    continue
                hops = out.setdefault(rec["rid"], {})
                first = hops.get(rec["hop"])
                rec["n"] = 1 + (first["n"] if first else 0)
                if first is None or rec["t"] < first["t"]:
                    hops[rec["hop"]] = rec
                else:
                    first["n"] = rec["n"]
    return out
