"""Speculative decoding (prompt lookup) in the engine: what it must never change.

Greedy output with speculation is the output without it, token for token, whatever else
runs in the step (other decodes, prefill chunks), under preemption, across the
disaggregated hand-off, with stop tokens, max_tokens and the context limit inside a draft.
The KV of rejected draft tokens never reaches the prefix cache: its hashes and KV match an
engine that never speculated. Most scenarios use dummy:tiny in fp32 (exact comparisons);
the last one, the real model in bf16 (near-tie rule of tests.kernels.greedy_match).
Every engine is leak-checked at teardown by the ``tiny_engine`` fixture.
"""

from __future__ import annotations

import random

import pytest
import torch

from services.config import EngineConfig, SpeculativeConfig
from services.engine.block_hash import hash_block
from services.engine.block_pool import BlockStored
from services.engine.engine import Engine
from services.engine.ngram_proposer import NgramIndex
from services.engine.sampling_params import SamplingParams
from tests.engine.checks import StepLog, assert_no_leaks, generate, generate_alone, run, tokens

SPEC = SpeculativeConfig(num_speculative_tokens=5)
GREEDY = dict(temperature=0, ignore_eos=True)


def grounded_prompts(n: int, seed: int = 0) -> dict[str, list[int]]:
    """Prompts with repeated spans (so drafts are found) of varied lengths."""
    rng = random.Random(seed)
    out = {}
    for i in range(n):
        span = [rng.randrange(2, 512) for _ in range(rng.randint(4, 30))]
        noise = [rng.randrange(2, 512) for _ in range(rng.randint(0, 12))]
        out[f"g{i}"] = span + noise + span[: rng.randint(2, len(span))]
    return out


class StepShapes:
    """Per step: (num_new_tokens, draft tokens) of each scheduled request."""

    def __init__(self, engine: Engine):
        self.steps: list[list[tuple[int, int]]] = []
        schedule = engine.scheduler.schedule

        def recording():
            out = schedule()
            if out:
                self.steps.append([(s.num_new_tokens, len(s.spec_token_ids)) for s in out.scheduled])
            return out

        engine.scheduler.schedule = recording

    def mixed(self) -> int:
        """Steps that verified a draft while another request prefilled a chunk."""
        return sum(1 for st in self.steps if any(d for _, d in st) and any(n > 1 and not d for n, d in st))


def spec_stats(engine: Engine) -> tuple[int, int]:
    s = engine.stats()
    return s["spec_draft_tokens"], s["spec_accepted_tokens"]


@pytest.fixture
def reference(tiny_engine):
    """No speculation, roomy cache: the tokens every scenario must reproduce."""
    return tiny_engine(num_blocks=512)


def test_greedy_output_is_unchanged_under_continuous_batching_and_chunked_prefill(tiny_engine, reference):
    engine = tiny_engine(speculative=SPEC, max_num_batched_tokens=48, long_prefill_chunk=16)
    shapes = StepShapes(engine)
    prompts = grounded_prompts(10)
    params = SamplingParams(max_tokens=40, **GREEDY)
    first = dict(list(prompts.items())[:4])
    late = dict(list(prompts.items())[4:])
    for rid, ids in first.items():
        engine.add_request(rid, ids, params)
    outs = {rid: [] for rid in prompts}
    for _ in range(6):  # the first ones are decoding (and drafting) when the rest arrive
        for o in engine.step():
            outs[o.request_id].append(o)
    for rid, ids in late.items():
        engine.add_request(rid, ids, params)
    for rid, o in run(engine).items():
        outs[rid] += o

    assert {rid: tokens(o) for rid, o in outs.items()} == generate_alone(reference, prompts, params)
    drafted, accepted = spec_stats(engine)
    assert 0 < accepted < drafted  # drafts were both accepted and rejected
    assert shapes.mixed() > 0  # verification shared steps with prefill chunks
    assert all(sum(n for n, _ in st) <= 48 for st in shapes.steps)  # drafts stay inside the token budget


def test_greedy_output_is_unchanged_under_preemption(tiny_engine, reference):
    engine = tiny_engine(num_blocks=14, speculative=SPEC)  # 13 usable blocks of 16 tokens for 6 requests
    prompts = grounded_prompts(6, seed=1)
    params = SamplingParams(max_tokens=48, **GREEDY)
    outs = generate(engine, prompts, params)

    assert {rid: tokens(o) for rid, o in outs.items()} == generate_alone(reference, prompts, params)
    assert engine.stats()["num_preemptions"] > 0
    assert spec_stats(engine)[1] > 0


class OracleDrafts:
    """Drafts that know the right continuation (from the reference run): right for a random
    number of tokens, then wrong, so every step accepts part of its draft and rejects the rest."""

    def __init__(self, prompts, reference_out, seed: int = 0, wrong: bool = True):
        self.full = {tuple(p): p + reference_out[rid] for rid, p in prompts.items()}
        self.rng = random.Random(seed)
        self.wrong = wrong

    def install(self, monkeypatch) -> None:
        oracle = self

        def propose(index, tokens, k):
            full = next(f for p, f in oracle.full.items() if tokens[: len(p)] == list(p))
            right = full[len(tokens): len(tokens) + k]
            m = oracle.rng.randint(0, len(right)) if oracle.wrong else len(right)
            draft = right[:m] + [(t + 7) % 500 + 2 for t in full[len(tokens) + m: len(tokens) + k]]
            return draft or [3]

        monkeypatch.setattr(NgramIndex, "propose", propose)


def test_rejected_drafts_are_rolled_back_and_never_reach_the_prefix_cache(tiny_engine, reference, monkeypatch):
    prompts = grounded_prompts(6, seed=2)
    params = SamplingParams(max_tokens=60, **GREEDY)
    want = generate_alone(reference, prompts, params)
    engine = tiny_engine(speculative=SpeculativeConfig(num_speculative_tokens=7, min_acceptance=0))
    OracleDrafts(prompts, want, seed=3).install(monkeypatch)
    events = []
    outs = generate(engine, prompts, params)
    events += engine.take_kv_events()

    assert {rid: tokens(o) for rid, o in outs.items()} == want
    drafted, accepted = spec_stats(engine)
    assert accepted > 60 and drafted - accepted > 60  # many of both

    # every stored block is a block of some request's true sequence, hashed along its chain
    true_blocks = {}
    for rid, p in prompts.items():
        seq, parent = p + want[rid], None
        for b in range(len(seq) // 16):
            parent = hash_block(parent, seq[16 * b: 16 * (b + 1)], engine.namespace)
            true_blocks[parent] = tuple(seq[16 * b: 16 * (b + 1)])
    stored = [(h, ev.token_ids[16 * i: 16 * (i + 1)]) for ev in events if isinstance(ev, BlockStored)
              for i, h in enumerate(ev.block_hashes)]
    assert stored and all(true_blocks.get(h) == t for h, t in stored)
    pool = engine.block_pool
    assert set(pool.cached) <= set(true_blocks)
    assert all(pool.block_tokens[b] == true_blocks[h] for h, b in pool.cached.items())

    # ... and holds the KV an engine that never speculated computed for those tokens
    ref_pool = reference.block_pool
    assert set(pool.cached) == set(ref_pool.cached)
    for h, b in pool.cached.items():
        torch.testing.assert_close(engine.kv_cache[b], reference.kv_cache[ref_pool.cached[h]], rtol=1e-5, atol=1e-5)

    # a request that continues one of them hits those blocks and decodes as the reference does
    rid, p = next(iter(prompts.items()))
    follow = {"follow": p + want[rid]}
    assert tokens(generate(engine, follow, params)["follow"]) == generate_alone(reference, follow, params)["follow"]
    assert engine.stats()["prefix_cache_hits"] > 0


def test_drafts_stay_inside_the_token_budget(tiny_engine, reference, monkeypatch):
    prompts = grounded_prompts(3, seed=8)
    params = SamplingParams(max_tokens=30, **GREEDY)
    want = generate_alone(reference, prompts, params)
    OracleDrafts(prompts, want, wrong=False).install(monkeypatch)  # a full draft every step
    engine = tiny_engine(speculative=SPEC, max_num_batched_tokens=8)
    log = StepLog(engine)
    shapes = StepShapes(engine)
    assert {rid: tokens(o) for rid, o in generate(engine, prompts, params).items()} == want
    assert all(sum(n for n, _ in st) <= 8 for st in shapes.steps)
    assert any(sum(n for n, _ in st) == 8 and any(0 < d < 5 for _, d in st) for st in shapes.steps)  # cut drafts
    # drafts only take what is left: every running request still runs in every step
    assert all(len(st) == running for st, running in zip(log.steps, log.running_after))


def test_stop_tokens_max_tokens_and_the_context_inside_a_draft(tiny_engine, reference, monkeypatch):
    prompts = grounded_prompts(4, seed=4)
    free = generate_alone(reference, prompts, SamplingParams(max_tokens=60, **GREEDY))
    OracleDrafts(prompts, free, wrong=False).install(monkeypatch)  # whole drafts accepted: they overshoot
    engine = tiny_engine(speculative=SpeculativeConfig(num_speculative_tokens=8))

    stop_at = {rid: t[17] for rid, t in free.items()}  # a token inside the output
    for rid, ids in prompts.items():
        params = SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop_at[rid]])
        out = generate(engine, {rid: ids}, params)[rid]
        assert tokens(out) == free[rid][: free[rid].index(stop_at[rid]) + 1] and out[-1].finish_reason == "stop"
    for rid, ids in prompts.items():
        out = generate(engine, {rid: ids}, SamplingParams(max_tokens=23, **GREEDY))[rid]
        assert tokens(out) == free[rid][:23] and out[-1].finish_reason == "length"

    short = tiny_engine(speculative=SpeculativeConfig(num_speculative_tokens=8), max_model_len=64)
    rid, ids = min(prompts.items(), key=lambda item: len(item[1]))
    assert len(ids) < 64 - 8
    out = generate(short, {rid: ids}, SamplingParams(max_tokens=None, **GREEDY))[rid]
    assert len(ids) + len(tokens(out)) == 64 and out[-1].finish_reason == "length"
    assert tokens(out) == free[rid][: 64 - len(ids)]


def test_penalties_logprobs_and_seeded_sampling_with_drafts(tiny_engine, reference, monkeypatch):
    engine = tiny_engine(speculative=SpeculativeConfig(num_speculative_tokens=5, min_acceptance=0))
    prompts = grounded_prompts(4, seed=5)
    penalised = SamplingParams(max_tokens=30, repetition_penalty=1.3, presence_penalty=0.5, logprobs=2, **GREEDY)
    want = generate(reference, prompts, penalised)
    # penalised text seldom repeats itself: drafts that are partly right make rows after accepted
    # drafts count, where the penalties must see those drafts as output
    OracleDrafts(prompts, {r: tokens(o) for r, o in want.items()}, seed=5).install(monkeypatch)
    got = generate(engine, prompts, penalised)
    assert {r: tokens(o) for r, o in got.items()} == {r: tokens(o) for r, o in want.items()}
    for rid in prompts:
        g = [lp for o in got[rid] for lp in o.logprobs or []]
        w = [lp for o in want[rid] for lp in o.logprobs or []]
        assert [lp.token_id for lp in g] == tokens(got[rid])
        assert [lp.logprob for lp in g] == pytest.approx([lp.logprob for lp in w], abs=1e-4)
    assert spec_stats(engine)[1] > 10
    monkeypatch.undo()

    seeded = SamplingParams(max_tokens=30, temperature=0.3, seed=11, ignore_eos=True)
    rid, ids = next(iter(prompts.items()))
    alone = tokens(generate(engine, {rid: ids}, seeded)[rid])
    others = {r: p for r, p in prompts.items() if r != rid}
    for r, p in others.items():
        engine.add_request(r, p, SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True))
    engine.add_request(rid, ids, seeded)
    assert tokens(run(engine)[rid]) == alone  # drafts come from its own tokens, draws from its own seed


def test_drafting_pauses_for_a_request_whose_drafts_keep_failing(tiny_engine, reference, monkeypatch):
    prompts = grounded_prompts(1, seed=6)
    params = SamplingParams(max_tokens=200, **GREEDY)
    want = generate_alone(reference, prompts, params)
    monkeypatch.setattr(NgramIndex, "propose", lambda index, toks, k: [(toks[-1] + 1) % 500 + 2] * k)  # never right
    engine = tiny_engine(speculative=SPEC)
    assert tokens(generate(engine, prompts, params)["g0"]) == want["g0"]
    s = engine.stats()
    assert s["spec_accepted_tokens"] < 3 and s["spec_pauses"] >= 3
    assert s["spec_drafts"] < 40  # of 200 steps: drafting was off most of the time


def test_disaggregated_decode_side_speculates(tiny_engine):
    from tests.engine.test_disagg_lifecycle import copy_blocks

    cfg = dict(long_prefill_chunk=16, max_num_batched_tokens=32)
    prefill, single = tiny_engine(**cfg), tiny_engine(**cfg)
    decode = tiny_engine(speculative=SPEC, **cfg)
    params = SamplingParams(max_tokens=30, **GREEDY)
    for rid, prompt in grounded_prompts(3, seed=7).items():
        want = tokens(generate(single, {rid: prompt}, params)[rid])
        dst = decode.reserve(rid, prompt, params)
        prefill.add_request(rid, prompt, params, prefill_only=True)
        last = [o for o in run(prefill)[rid]][-1]
        copy_blocks(prefill, last.block_ids, decode, dst)
        prefill.release(rid)
        decode.start_decode(rid, last.new_token_ids[0])
        assert tokens(run(decode)[rid]) == want  # the first token (from the prefill) comes out first
    assert spec_stats(decode)[1] > 0 and spec_stats(prefill) == (0, 0)


@pytest.mark.slow
def test_real_model_bf16_greedy_output_is_unchanged(default_tokenizer):
    """The default model on its default bf16 path: speculation on and off, token-identical up
    to the first bf16 near-tie (verification rows go through the projection kernel in bigger
    row blocks than single decodes, which rounds differently)."""
    from tests.engine.recording import Recorder
    from tests.kernels.greedy_match import assert_same_greedy

    code = "def area(width, height):\n    result = width * height\n    return result\n" * 2
    chats = [f"Repeat this code, renaming `result` to `total`:\n```python\n{code}```",
             "Copy this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
             "Write a short poem about the sea."]
    prompts = {f"p{i}": default_tokenizer.apply_chat_template([{"role": "user", "content": c}])
               for i, c in enumerate(chats)}
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)  # same lengths to compare
    engine = Engine(EngineConfig(kv_cache_bytes=64 << 20, enable_prefix_caching=False, speculative=SPEC))
    speculator, engine.speculator = engine.speculator, None  # one model load: the reference runs without
    rec = Recorder(engine)
    want = {rid: tokens(o) for rid, o in generate(engine, prompts, params).items()}
    want_logits = {rid: list(rows) for rid, rows in rec.logits.items()}
    engine.speculator = speculator
    got = {rid: tokens(o) for rid, o in generate(engine, prompts, params).items()}
    assert_same_greedy(got, want, want_logits, {}, "bfloat16")
    assert spec_stats(engine)[1] > 10  # the copy prompts were drafted and accepted
    assert_no_leaks(engine)
