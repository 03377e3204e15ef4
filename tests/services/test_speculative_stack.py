"""Speculative decoding on the disaggregated path: the decode worker (``--speculative ngram``)
drafts and verifies after its KV arrived over UCX from a prefill worker that never speculates.
Greedy output equals an in-process engine without speculation; the decode worker's metrics
show accepted drafts; no KV block stays in use."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.services.stack import Stack

pytestmark = pytest.mark.slow

# answers copied from the prompt: what prompt lookup drafts well
CHATS = ["Repeat exactly: the cat sat on the mat, the dog sat on the log, the bird sat on the branch.",
         "Copy this list: apples, bananas, cherries, dates, elderberries, figs, grapes."]


def _counter(metrics: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name + "{"))


def test_decode_worker_speculates_and_output_equals_the_engine_without(redis_url):
    from services.config import EngineConfig
    from services.engine.engine import Engine
    from services.engine.sampling_params import SamplingParams

    engine = Engine(EngineConfig(dtype="float32", kv_cache_bytes=64 << 20))
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    want = []
    for i, ids in enumerate(prompts):
        engine.add_request(f"ref{i}", ids, SamplingParams(max_tokens=40, temperature=0))
    outs = {f"ref{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
    want = [outs[f"ref{i}"] for i in range(len(prompts))]

    with Stack(redis_url, prefill=1, decode=1, worker_args=("--speculative", "ngram")) as stack:
        async def run_all():
            return await asyncio.gather(*(stack.agenerate(stack.request(token_ids=ids, max_tokens=40))
                                          for ids in prompts))

        results = asyncio.run(run_all())
        for (ids, _, finish), expected in zip(results, want):
            assert ids == expected
            assert finish.prefill_worker.startswith("prefill-") and finish.decode_worker.startswith("decode-")
        deadline = time.monotonic() + 10  # worker stats reach /metrics every 0.25 s
        while _counter(stack.metrics("decode-0"), "pdserve_spec_decode_accepted_tokens_total") < 10:
            assert time.monotonic() < deadline, "the decode worker reported no accepted drafts"
            time.sleep(0.2)
        assert _counter(stack.metrics("prefill-0"), "pdserve_spec_decode_draft_tokens_total") == 0
        assert stack.wait_idle(["prefill-0", "decode-0"]) == {"prefill-0": 0, "decode-0": 0}
