"""Probe: what a coalesced follower's stream costs the gateway per chunk in formatting and SSE encoding.

    PYTHONPATH=. python benchmarks/probes/follower_chunk_cost.py

The part of a follower's work that followers of one generation could share (one encoded
chunk, with only ``id`` and ``created`` differing per request) is ``StreamFormatter.chunk``
plus ``sse.encode``. This times the two for one streamed chat token (median of 5 runs of
20,000, CPU time of this process) so the saving can be set against the gateway's measured
CPU per output token in ``pdserve bench coalesce`` (its ``cpu_s`` per side). What stays
per follower however it is shared: the ASGI write of each event to its own connection.
"""

from __future__ import annotations

import time

from services.gateway import sse
from services.gateway.openai_format import StreamFormatter
from services.gateway.request_record import RequestRecord


def main() -> None:
    record = RequestRecord(request_id="gw-0123456789ab.0123456789abcdef0123456789abcdef", kind="chat",
                           model="SmolLM2-135M-Instruct", created=1700000000, tenant="default", deadline=0,
                           prompt_tokens=50, include_usage=True, logprobs=None, source="", coalesce="")
    fmt = StreamFormatter(record, include_usage=True)
    data = {"text": " hello", "token_ids": [123]}
    runs, n = [], 20000
    for _ in range(5):
        started = time.process_time()
        for _ in range(n):
            sse.encode(fmt.chunk(data)[0], "1700000000000-5")
        runs.append((time.process_time() - started) / n)
    print(f"StreamFormatter.chunk + sse.encode: {sorted(runs)[2] * 1e6:.1f} us CPU per streamed token")


if __name__ == "__main__":
    main()
