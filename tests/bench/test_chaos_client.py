"""The chaos bench's client counts what it received: duplicates and gaps from SSE ids and per-token logprobs,
across a Last-Event-ID resume; a stream cut without a final event is lost, an error event is a clear error."""

from __future__ import annotations

import asyncio
import json

from services.bench.chaos_client import COMPLETED, ERRORED, LOST, ChaosClient, Outcome, _read_sse, _Received


def _event(event_id: str, tokens: int = 1, usage: int | None = None, error: str | None = None) -> list[str]:
    if error is not None:
        body = {"error": {"message": error}}
    else:
        body = {"choices": [{"index": 0, "delta": {"content": "x" * tokens},
                             "logprobs": {"content": [{"token": "x", "logprob": 0.0}] * tokens}}]}
        if usage is not None:
            body = {"choices": [], "usage": {"completion_tokens": usage}}
    return [f"id: {event_id}", f"data: {json.dumps(body)}", ""]


async def _lines(*events: list[str]):
    for event in events:
        for line in event:
            yield line


def _tally(*connections) -> Outcome:
    received = _Received()
    for events in connections:
        asyncio.run(_read_sse(_lines(*events), received))
    out = Outcome(LOST, 0.0)
    ChaosClient._tally(out, received)
    return out


DONE = ["id: 9-0", "data: [DONE]", ""]


def test_a_whole_stream_over_two_connections_has_no_duplicate_and_no_gap():
    out = _tally([_event("1-0"), _event("2-0", 2)], [_event("3-0"), _event("4-0", usage=4), DONE])
    assert (out.kind, out.tokens_seen, out.duplicate_tokens, out.token_gaps) == (COMPLETED, 4, 0, 0)


def test_an_event_delivered_again_after_a_resume_counts_its_tokens_as_duplicates():
    out = _tally([_event("1-0"), _event("2-0", 2)], [_event("2-0", 2), _event("3-0"), _event("4-0", usage=4), DONE])
    assert out.duplicate_tokens == 2 and out.token_gaps == 0


def test_tokens_the_client_never_received_are_gaps():
    out = _tally([_event("1-0")], [_event("3-0"), _event("4-0", usage=5), DONE])
    assert out.kind == COMPLETED and out.token_gaps == 3 and out.duplicate_tokens == 0


def test_a_stream_cut_without_a_final_event_is_lost_and_an_error_event_is_errored():
    assert _tally([_event("1-0"), _event("2-0")]).kind == LOST
    assert _tally([_event("1-0"), _event("1-0", error="the worker died"), DONE]).kind == ERRORED


def test_reading_stops_after_the_asked_number_of_token_events():
    received = _Received()
    stopped = asyncio.run(_read_sse(_lines(_event("1-0"), _event("2-0"), _event("3-0"), DONE), received, 2))
    assert stopped and received.tokens == 2 and received.last_id == "2-0" and not received.done
