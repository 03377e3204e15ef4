"""AsyncEngine on dummy:tiny: concurrent streams, a consumer that goes away, and
a bad request among good ones. Every test ends with the leak check, run on the
engine thread (the only thread that may touch the Engine)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from services.engine.async_engine import AsyncEngine
from services.engine.sampling_params import SamplingParams
from services.errors import InvalidRequestError
from tests.engine.checks import generate_alone

GREEDY = dict(temperature=0, ignore_eos=True)
PROMPTS = {f"r{i}": list(range(10 + 7 * i, 10 + 7 * i + n)) for i, n in enumerate((5, 30, 12, 50))}


@pytest.fixture
def engines(tiny_engine):
    """(AsyncEngine, its Engine, a reference Engine with the same weights for solo runs)."""
    engine, reference = tiny_engine(), tiny_engine()
    async_engine = AsyncEngine(engine)
    yield async_engine, engine, reference
    async_engine.shutdown()


def run_async(coro, timeout: float = 120):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


async def collect(async_engine, prompt, params, request_id=None) -> list:
    return [out async for out in async_engine.generate(prompt, params, request_id=request_id)]


async def engine_state(async_engine, engine):
    """(live request ids, used blocks), read on the engine thread after every command queued so far."""
    return await async_engine.call(lambda: (sorted(engine.requests), engine.block_pool.num_used))


def token_ids(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_concurrent_streams_complete(engines):
    async_engine, engine, reference = engines
    params = SamplingParams(max_tokens=10, **GREEDY)

    async def main():
        results = await asyncio.gather(*(collect(async_engine, p, params, rid) for rid, p in PROMPTS.items()))
        return results, await engine_state(async_engine, engine)

    results, state = run_async(main())

    expected = generate_alone(reference, PROMPTS, params)
    for rid, outs in zip(PROMPTS, results):
        assert all(o.request_id == rid for o in outs)
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert not any(o.finished for o in outs[:-1])
        assert token_ids(outs) == expected[rid]
    assert state == ([], 0)


def test_cancelled_consumer_aborts_its_request(engines):
    async_engine, engine, _ = engines
    short = SamplingParams(max_tokens=8, **GREEDY)
    endless = SamplingParams(max_tokens=None, **GREEDY)  # runs until the context is full unless aborted

    async def main():
        got_some = asyncio.Event()
        seen = []

        async def consumer():
            async for out in async_engine.generate(PROMPTS["r1"], endless, request_id="leaving"):
                seen.append(out)
                if len(seen) == 3:
                    got_some.set()

        leaving = asyncio.create_task(consumer())
        others = [asyncio.create_task(collect(async_engine, PROMPTS[r], short, r)) for r in ("r0", "r2")]
        await got_some.wait()
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        right_after = await engine_state(async_engine, engine)
        results = await asyncio.gather(*others)
        return seen, right_after, results, await engine_state(async_engine, engine)

    seen, right_after, results, final = run_async(main())

    assert "leaving" not in right_after[0]  # aborted as soon as its consumer went away
    assert 3 <= len(seen) and not seen[-1].finished
    for outs in results:
        assert outs[-1].finish_reason == "length" and len(token_ids(outs)) == 8
    assert final == ([], 0)


def test_consumer_that_stops_iterating_aborts_its_request(engines):
    async_engine, engine, _ = engines

    async def main():
        stream = async_engine.generate(PROMPTS["r0"], SamplingParams(max_tokens=None, **GREEDY), request_id="r0")
        async with contextlib.aclosing(stream):
            async for out in stream:
                if out.new_token_ids:
                    break
        return await engine_state(async_engine, engine)

    assert run_async(main()) == ([], 0)


def test_invalid_request_raises_without_affecting_others(engines):
    async_engine, engine, reference = engines
    params = SamplingParams(max_tokens=6, **GREEDY)

    async def main():
        good = [asyncio.create_task(collect(async_engine, PROMPTS[r], params, r)) for r in ("r0", "r3")]
        bad = [asyncio.create_task(collect(async_engine, ids, params)) for ids in ([], [5, 10**6])]
        await asyncio.sleep(0)  # both adds are queued
        # Commands run in order and their results come back in order, so once a later call has
        # returned, the bad requests have had their answer: no timeout needed to spot a hang.
        await async_engine.call(lambda: None)
        await asyncio.sleep(0)
        settled = [task.done() for task in bad]
        for task in bad:
            task.cancel()
        errors = [task.exception() if not task.cancelled() else None for task in bad] if all(settled) else []
        return settled, errors, await asyncio.gather(*good), await engine_state(async_engine, engine)

    settled, errors, results, state = run_async(main())

    expected = generate_alone(reference, {r: PROMPTS[r] for r in ("r0", "r3")}, params)
    assert [token_ids(outs) for outs in results] == [expected["r0"], expected["r3"]]
    assert state == ([], 0)
    assert settled == [True, True], "a bad request's stream never raised"
    assert all(isinstance(e, InvalidRequestError) and e.param == "prompt" for e in errors)
    assert "empty" in errors[0].message and "outside the vocabulary" in errors[1].message


def test_duplicate_request_id_is_rejected(engines):
    async_engine, engine, _ = engines

    async def main():
        first = async_engine.generate(PROMPTS["r0"], SamplingParams(max_tokens=4, **GREEDY), request_id="same")
        async with contextlib.aclosing(first):
            out = await anext(first)
            with pytest.raises(InvalidRequestError, match="already"):
                await collect(async_engine, PROMPTS["r1"], SamplingParams(max_tokens=4), request_id="same")
            rest = [o async for o in first]
        return [out, *rest], await engine_state(async_engine, engine)

    outs, state = run_async(main())
    assert outs[-1].finished and len(token_ids(outs)) == 4  # the first stream was not disturbed
    assert state == ([], 0)


def test_consumer_cancelled_before_its_request_starts(engines):
    async_engine, engine, _ = engines

    async def main():
        async def consumer():
            async for _ in async_engine.generate(PROMPTS["r0"], SamplingParams(max_tokens=None, **GREEDY),
                                                 request_id="early"):
                pass

        task = asyncio.create_task(consumer())
        await asyncio.sleep(0)  # the task has queued the add and is waiting for it
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await engine_state(async_engine, engine)

    assert run_async(main()) == ([], 0)


def test_a_failed_step_fails_its_requests_not_the_blocks_a_transfer_owns(tiny_engine):
    # issue 18: a failing step aborted every request, a reservation a KV transfer was still writing
    # into included: its blocks went back to the pool under the transfer, and the decode that followed
    # found no reservation (InvalidRequestError: a 400 dead letter for a server fault)
    from kvtransfer import Receiver, Sender, TransferConfig
    from services.handoff import EngineBlockOwner, decode_after_transfer, prefill_and_send, reserve_for_transfer

    decode, prefill, reference = tiny_engine(), tiny_engine(), tiny_engine()
    decode_async, prefill_async = AsyncEngine(decode), AsyncEngine(prefill)
    params = SamplingParams(max_tokens=6, **GREEDY)

    def break_next_step():
        real = decode.runner.execute

        def device_lost(sched):
            decode.runner.execute = real
            raise RuntimeError("device lost")

        decode.runner.execute = device_lost

    async def main():
        config = TransferConfig(transport="loopback")
        owner = EngineBlockOwner(decode_async)
        receiver = Receiver(decode.kv_cache, decode.namespace, owner, config)
        await receiver.start()
        sender = Sender(prefill.kv_cache, prefill.namespace, config, transport=receiver.transport)
        pending = await reserve_for_transfer(decode_async, owner, receiver, "handed-off", PROMPTS["r1"], params, 30)
        # a finished prefill-only request: its blocks are held for a sender until released
        async for _ in decode_async.generate(PROMPTS["r3"], params, "held", prefill_only=True):
            pass
        await decode_async.call(break_next_step)
        failed = await collect(decode_async, PROMPTS["r0"], params, "in-the-step")
        survivors = await decode_async.call(lambda: {rid: (r.status.value, len(r.block_ids))
                                                     for rid, r in decode.requests.items()})
        await decode_async.call(lambda: decode.release("held"))
        await prefill_and_send(prefill_async, sender, pending.descriptor, PROMPTS["r1"], params)
        decoded = [out async for out in decode_after_transfer(decode_async, "handed-off", await pending)]
        await receiver.close()
        await prefill_async.call(lambda: None)  # the prefill side's release (queued by prefill_and_send) ran
        return failed, survivors, decoded, await engine_state(decode_async, decode)

    try:
        failed, survivors, decoded, state = run_async(main())
    finally:
        decode_async.shutdown()
        prefill_async.shutdown()
    assert failed[-1].finish_reason == "error" and "device lost" in failed[-1].error
    assert survivors == {"handed-off": ("reserved", 2), "held": ("prefilled", 4)}  # 30, 50 tokens
    assert token_ids(decoded) == generate_alone(reference, {"r1": PROMPTS["r1"]}, params)["r1"]
    assert state == ([], 0)


def test_a_prefill_whose_reservation_fails_frees_its_blocks_at_once(tiny_engine):
    # the decode side's Reserve failing (a full decode worker) while the prompt is still being
    # prefilled left the prefill stream unclosed: the request ran on, ended prefilled and held its
    # blocks until the GC collected the stream, which an idle worker may never do (a chaos run found
    # 14 blocks held on an idle prefill worker). The GC is off here, so only closing the stream frees them.
    import gc

    from services.handoff import prefill_and_send

    prefill = tiny_engine(long_prefill_chunk=32, max_num_batched_tokens=32)  # the prompt in 7 chunks
    prefill_async = AsyncEngine(prefill)
    params = SamplingParams(max_tokens=6, **GREEDY)
    long_prompt = list(range(3, 3 + 200))

    async def reservation_fails():
        await asyncio.sleep(0)
        raise RuntimeError("no room for the KV blocks on the decode worker")

    async def main():
        with pytest.raises(RuntimeError, match="no room"):
            await prefill_and_send(prefill_async, None, reservation_fails(), long_prompt, params,
                                   request_id="left-behind")
        return await engine_state(prefill_async, prefill)

    gc.disable()
    try:
        state = run_async(main())
    finally:
        gc.enable()
        prefill_async.shutdown()
    assert state == ([], 0)


def test_a_finals_only_stream_gets_its_last_output_while_the_step_hook_sees_every_token(engines):
    # the decode worker's results mode: its step hook writes every token to Redis, so the request's own
    # stream is handed only the finished output (no per-token wake-up of the event loop)
    async_engine, _, _ = engines
    hooked: list[int] = []
    async_engine.on_step = lambda outs: hooked.extend(t for o in outs if o.request_id == "f" for t in o.new_token_ids)
    async_engine.finals_only.add("f")
    params = SamplingParams(max_tokens=9, **GREEDY)

    async def both():
        return await asyncio.gather(collect(async_engine, PROMPTS["r1"], params, request_id="f"),
                                    collect(async_engine, PROMPTS["r1"], params, request_id="g"))

    finals, every = run_async(both())
    assert len(finals) == 1 and finals[0].finished and finals[0].num_output_tokens == 9
    assert len(every) > 1 and hooked == token_ids(every)  # the other stream is unchanged; the hook saw them all
    async_engine.finals_only.discard("f")


def test_a_command_submitted_just_before_shutdown_still_runs(tiny_engine):
    # a decode worker's transfer owner gives a reservation's blocks back by submitting a release to the
    # engine thread; submitted as the worker shut down, after the loop's last pass over its commands, it
    # never ran and the request stayed with its blocks (CI: "requests left behind: ['r']")
    engine = tiny_engine()
    async_engine = AsyncEngine(engine)
    ran = []
    take = engine.take_pending_outputs

    def last_pass():  # runs on the engine thread after its commands: submit one, then stop
        if not ran:
            ran.append(False)
            async_engine.submit(lambda: ran.append(True))
            async_engine._stopped = True
        return take()

    engine.take_pending_outputs = last_pass
    async_engine.submit(lambda: None)
    async_engine._thread.join(timeout=10)
    assert ran == [False, True]
