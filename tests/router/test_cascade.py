"""The cascade's decision (services/cascade.py, services/router/cascade.py): which tier answers for a
given signal, threshold and token count, what reaches the result stream (only the answering tier's
tokens, tagged with its model), that an escalated tier's generation is closed, and the spec's checks.
The tiers are scripted generations (their log-probabilities chosen); the result stream is real Redis."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import redis.asyncio as aioredis

from proto.pdserve.v1 import common_pb2
from services.cascade import CascadeSpec, parse_tiers
from services.engine.sampling_params import SamplingParams
from services.errors import InvalidRequestError
from services.queue.keys import result_stream
from services.queue.message import QueuedRequest
from services.queue.results import ResultWriter
from services.router.cascade import run_cascade


class ScriptedTiers:
    """Dispatcher stand-in: each model answers its scripted tokens, one per chunk, with these logprobs."""

    def __init__(self, answers: dict[str, list[tuple[int, float]]]):
        self.answers = answers
        self.calls: list[tuple[str, SamplingParams]] = []
        self.closed: list[str] = []

    async def generate(self, request_id, token_ids, params, priority=0, deadline=0.0, session_key="", model=""):
        self.calls.append((model, params))
        try:
            for token, logprob in self.answers[model]:
                chunk = common_pb2.TokenChunk(token_ids=[token], text=f"<{token}>")
                if params.logprobs is not None:
                    chunk.logprobs.add(token_id=token, logprob=logprob, token=f"<{token}>")
                yield chunk
            yield common_pb2.Finish(finish_reason="stop", usage=common_pb2.Usage(
                completion_tokens=len(self.answers[model])))
        finally:
            self.closed.append(model)


SURE = [(10, -0.1), (11, -0.2), (12, -0.1), (13, -0.3), (14, -0.2)]
UNSURE = [(20, -0.1), (21, -3.0), (22, -0.2), (23, -0.1), (24, -0.2)]  # mean -0.85 over 4, min -3.0
LARGE = [(30, -0.5), (31, -0.5), (32, -0.5)]


async def _run(redis_url, spec, answers, params=None, rid="req-1"):
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.delete(result_stream(rid))
        tiers = ScriptedTiers(answers)
        outcome = await run_cascade(tiers, ResultWriter(client), spec, rid, [1, 2, 3],
                                    params or SamplingParams(max_tokens=8, temperature=0))
        events = [json.loads(f[b"data"]) for _, f in await client.xrange(result_stream(rid))]
        return outcome, tiers, events
    finally:
        await client.aclose()


def test_a_confident_small_tier_answers_and_its_held_tokens_are_released(redis_url):
    spec = CascadeSpec(("small", "large"), "mean", tokens=4, threshold=-1.0)
    outcome, tiers, events = asyncio.run(_run(redis_url, spec, {"small": SURE, "large": LARGE}))
    assert outcome.model == "small" and outcome.tried == ["small"]
    assert [t for e in events for t in e["token_ids"]] == [10, 11, 12, 13, 14]
    assert {e["model"] for e in events} == {"small"}
    assert [m for m, _ in tiers.calls] == ["small"]
    assert outcome.summary()["escalations"] == 0 and outcome.confidence == [pytest.approx(-0.175)]


def test_an_unsure_small_tier_escalates_and_none_of_its_tokens_is_written(redis_url):
    spec = CascadeSpec(("small", "large"), "min", tokens=4, threshold=-1.0)
    outcome, tiers, events = asyncio.run(_run(redis_url, spec, {"small": UNSURE, "large": LARGE}))
    assert outcome.model == "large" and outcome.tried == ["small", "large"]
    assert [t for e in events for t in e["token_ids"]] == [30, 31, 32]
    assert {e["model"] for e in events} == {"large"}
    assert tiers.closed == ["small", "large"]  # the small tier's generation closed before the large ran
    assert outcome.dropped_tokens == 4 and outcome.confidence == [-3.0]


def test_the_signal_and_the_token_count_decide(redis_url):
    answers = {"small": UNSURE, "large": LARGE}
    # mean over the first 4: -0.85 passes -1.0; over the first 2 (-1.55) it does not; min over 4 (-3.0) neither
    for signal, tokens, expected in (("mean", 4, "small"), ("mean", 2, "large"), ("min", 4, "large"),
                                     ("min", 1, "small")):
        outcome, _, _ = asyncio.run(_run(redis_url, CascadeSpec(("small", "large"), signal, tokens, -1.0), answers))
        assert outcome.model == expected, (signal, tokens)


def test_a_short_answer_is_judged_on_the_tokens_it_has(redis_url):
    spec = CascadeSpec(("small", "large"), "mean", tokens=8, threshold=-1.0)
    outcome, _, events = asyncio.run(_run(redis_url, spec, {"small": SURE[:2], "large": LARGE}))
    assert outcome.model == "small" and [t for e in events for t in e["token_ids"]] == [10, 11]


def test_three_tiers_pass_it_on_until_one_is_sure(redis_url):
    spec = CascadeSpec(("a", "b", "c"), "mean", tokens=2, threshold=-0.5)
    bad = [(1, -2.0), (2, -2.0)]
    outcome, tiers, events = asyncio.run(_run(redis_url, spec, {"a": bad, "b": SURE, "c": LARGE}))
    assert outcome.model == "b" and outcome.tried == ["a", "b"]
    assert [m for m, _ in tiers.calls] == ["a", "b"]


def test_logprobs_are_asked_of_the_scored_tiers_only(redis_url):
    spec = CascadeSpec(("small", "large"), "mean", tokens=2, threshold=1.0)  # always escalates
    _, tiers, events = asyncio.run(_run(redis_url, spec, {"small": SURE, "large": LARGE}))
    assert [(m, p.logprobs) for m, p in tiers.calls] == [("small", 0), ("large", None)]
    assert all("logprobs" not in e for e in events)  # the client asked for none


def test_threshold_extremes_always_and_never_escalate():
    spec = CascadeSpec(("s", "l"), threshold=math.inf)
    assert spec.escalates([0.0]) and not CascadeSpec(("s", "l"), threshold=-math.inf).escalates([-50.0])


def test_the_spec_round_trips_through_the_queue_entry():
    spec = CascadeSpec(parse_tiers(" small , large "), "min", 3, -math.inf)
    q = QueuedRequest("r1", "t", "standard", "small", [1, 2], cascade=spec.to_json())
    back = QueuedRequest.from_fields(q.to_fields())
    assert CascadeSpec.from_json(back.cascade) == spec
    assert "cascade" not in QueuedRequest("r2", "t", "standard", "small", [1]).to_fields()
    with pytest.raises(InvalidRequestError):
        CascadeSpec.from_json('{"tiers": ["only"], "signal": "mean", "tokens": 2, "threshold": 0}')


@pytest.mark.parametrize("kwargs, message", [
    ({"tiers": ("one",)}, "two or more"), ({"tiers": ("a", "a")}, "distinct"), ({"tiers": ("a", "auto")}, "auto"),
    ({"tiers": ("a", "b"), "signal": "max"}, "signal"), ({"tiers": ("a", "b"), "tokens": 0}, "tokens"),
    ({"tiers": ("a", "b"), "threshold": math.nan}, "threshold")])
def test_a_bad_spec_says_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CascadeSpec(**kwargs)
