"""The KV spill tier on the real stack: a prefill worker whose pool evicted a conversation restores
it from its spill tier (lossless mode here) instead of recomputing it; the answer is the one it
gave when it computed everything; its /metrics count the restore; no block stays in use."""

from __future__ import annotations

import random
import time

import pytest

from tests.services.stack import Stack

pytestmark = pytest.mark.slow


def _counter(metrics: str, name: str, **labels) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(name + "{") and all(w in line for w in want))


def test_evicted_prefix_is_restored_from_the_spill_tier_with_the_same_answer(redis_url):
    rng = random.Random(0)
    # four 150-token prompts through a 29-block pool (fp32): the first is evicted by the time it returns
    prompts = [[rng.randrange(1000, 40000) for _ in range(150)] for _ in range(4)]
    spill = ("--kv-cache-gb", "0.02", "--kv-spill-gb", "0.05", "--kv-spill-dtype", "auto")
    # the decode worker holds (spilled) the returning prompt too and would prefill it itself (docs/structure.md,
    # conditional disaggregation rule 3); this test is about the prefill worker's tier, so the hand-off stays
    with Stack(redis_url, prefill=1, decode=1, worker_args=spill, router_args=("--no-local-prefill-cached",)) as stack:
        first = [stack.generate(stack.request(token_ids=ids, max_tokens=6)) for ids in prompts]
        assert all(f[2].usage.cached_prompt_tokens == 0 for f in first)
        ids, _, finish = stack.generate(stack.request(token_ids=prompts[0], max_tokens=6))
        assert finish.usage.cached_prompt_tokens == 144  # 9 full blocks restored, the last one computed
        assert ids == first[0][0]
        deadline = time.monotonic() + 10  # worker stats reach /metrics every 0.25 s
        while _counter(stack.metrics("prefill-0"), "pdserve_kv_restores_total") < 9:
            assert time.monotonic() < deadline, "the prefill worker reported no restore"
            time.sleep(0.2)
        assert _counter(stack.metrics("prefill-0"), "pdserve_kv_tier_hits_total", tier="spill") >= 9
        assert stack.wait_idle(["prefill-0", "decode-0"]) == {"prefill-0": 0, "decode-0": 0}
