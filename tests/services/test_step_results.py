"""The decode worker's step writer (services/decode/step_results.py): every token reaches the result stream,
in order; with a stream interval, N tokens a chunk, with a stream flush, at most one chunk per M ms; the first
and the last at once. The flush is driven by a clock the test sets (step times), never by the wall clock."""

from __future__ import annotations

import asyncio

import pytest

from services.decode.step_results import StepResultWriter
from services.engine.outputs import RequestOutput
from services.queue.keys import result_stream
from services.queue.results import decode_event
from services.stream_holding import STREAM_FLUSH_MS, resolve


def _steps(rid: str, tokens: int, *, abort_after: int | None = None) -> list[list[RequestOutput]]:
    """One output per step, one token each; the last finished ("length"), or an abort with no token after
    ``abort_after`` tokens."""
    steps = [[RequestOutput(rid, [100 + k], f"<{k}>", finished=k == tokens - 1 and abort_after is None,
                            finish_reason="length" if k == tokens - 1 and abort_after is None else None)]
             for k in range(abort_after or tokens)]
    if abort_after is not None:
        steps.append([RequestOutput(rid, [], "", finished=True, finish_reason="abort")])
    return steps


async def _chunks(r, interval: int, steps: list[list[RequestOutput]], rid: str, flush_ms: float = 0.0,
                  step_ms: float = 0.0) -> list[list[int]]:
    """The chunks written for ``steps``, the n-th step ending at ``n * step_ms`` ms on the writer's clock."""
    now = [0.0]
    writer = StepResultWriter(r, interval=interval, flush_ms=flush_ms, clock=lambda: now[0])
    writer.start()
    writer.track(rid, rid)
    for n, outputs in enumerate(steps):
        now[0] = n * step_ms / 1e3
        writer.on_step(outputs, n)
        await asyncio.sleep(0)  # the step's chunks reach the writer task (engine thread -> loop)
    await writer.flushed(rid)
    await writer.stop()
    entries = await r.xrange(result_stream(rid))
    return [decode_event(fields)[1]["token_ids"] for _, fields in entries]


def test_every_token_in_its_own_chunk_by_default(with_redis):
    async def go(r):
        assert await _chunks(r, 1, _steps("a", 5), "a") == [[100], [101], [102], [103], [104]]

    with_redis(go)


def test_an_interval_groups_tokens_with_the_first_and_the_last_at_once(with_redis):
    async def go(r):
        got = await _chunks(r, 3, _steps("b", 9), "b")
        assert got == [[100], [101, 102, 103], [104, 105, 106], [107, 108]]  # first alone; the rest by 3, then
        # the finishing step's with what it held

    with_redis(go)


def test_tokens_held_when_a_request_is_aborted_are_written(with_redis):
    async def go(r):
        got = await _chunks(r, 4, _steps("c", 0, abort_after=3), "c")
        assert got == [[100], [101, 102]]  # nothing lost: the abort step flushes what was held
        texts = [decode_event(f)[1]["text"] for _, f in await r.xrange(result_stream("c"))]
        assert texts == ["<0>", "<1><2>"]

    with_redis(go)


def test_a_stream_flush_writes_fast_steps_at_most_once_per_flush(with_redis):
    async def go(r):
        # steps of 5 ms, a flush of 20 ms: the first token alone, then what came in 20 ms, the last at once
        got = await _chunks(r, 1, _steps("d", 10), "d", flush_ms=20, step_ms=5)
        assert got == [[100], [101, 102, 103, 104], [105, 106, 107, 108], [109]]

    with_redis(go)


def test_a_stream_flush_leaves_steps_slower_than_it_one_token_a_chunk(with_redis):
    async def go(r):
        got = await _chunks(r, 1, _steps("e", 5), "e", flush_ms=20, step_ms=25)
        assert got == [[100], [101], [102], [103], [104]]

    with_redis(go)


def test_tokens_held_by_a_stream_flush_are_written_when_the_request_is_aborted(with_redis):
    async def go(r):
        got = await _chunks(r, 1, _steps("f", 0, abort_after=3), "f", flush_ms=20, step_ms=5)
        assert got == [[100], [101, 102]]

    with_redis(go)


def test_the_two_ways_of_holding_tokens_are_one_at_a_time():
    with pytest.raises(ValueError, match="give one"):
        StepResultWriter(None, interval=4, flush_ms=20)
    assert resolve(None, None) == (1, STREAM_FLUSH_MS)  # the default: time-based
    assert resolve(1, None) == (1, 0.0)  # --stream-interval 1 alone: every token, as vLLM's default
    assert resolve(4, None) == (4, 0.0)
    assert resolve(None, 0) == (1, 0.0)
    assert resolve(4, 0) == (4, 0.0)
    with pytest.raises(ValueError, match="give one"):
        resolve(4, 10)
    with pytest.raises(ValueError, match="0-1000 ms"):
        resolve(None, float("nan"))
