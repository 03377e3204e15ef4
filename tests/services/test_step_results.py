"""The decode worker's step writer (services/decode/step_results.py): every token reaches the result stream,
in order; with a stream interval, N tokens a chunk, the first and the last at once."""

from __future__ import annotations

import asyncio

from services.decode.step_results import StepResultWriter
from services.engine.outputs import RequestOutput
from services.queue.keys import result_stream
from services.queue.results import decode_event


def _steps(rid: str, tokens: int, *, abort_after: int | None = None) -> list[list[RequestOutput]]:
    """One output per step, one token each; the last finished ("length"), or an abort with no token after
    ``abort_after`` tokens."""
    steps = [[RequestOutput(rid, [100 + k], f"<{k}>", finished=k == tokens - 1 and abort_after is None,
                            finish_reason="length" if k == tokens - 1 and abort_after is None else None)]
             for k in range(abort_after or tokens)]
    if abort_after is not None:
        steps.append([RequestOutput(rid, [], "", finished=True, finish_reason="abort")])
    return steps


async def _chunks(r, interval: int, steps: list[list[RequestOutput]], rid: str) -> list[list[int]]:
    writer = StepResultWriter(r, interval=interval)
    writer.start()
    writer.track(rid, rid)
    for n, outputs in enumerate(steps):
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
