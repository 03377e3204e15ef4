"""``Engine.add_choices``: n choices of one prompt computed once and forked (shared full blocks, the partial last
block copied), with the same outputs as n separate requests, and every block free after every path."""

from __future__ import annotations

import pytest
import torch

from services.engine.sampling_params import SamplingParams
from tests.engine.checks import assert_no_leaks, run, tokens

BS = 16


def _prompt(engine, words: int = 30) -> list[int]:
    ids = engine.tokenizer.encode("The sailors told stories of the sea " + "and the wind " * words)
    assert len(ids) % BS, "the test needs a partial last block"
    return ids


def _separately(engine, prompt: list[int], params: list[SamplingParams]) -> dict[str, list[int]]:
    """Today's n > 1: one request per choice, each alone in an engine with an empty prefix cache."""
    out = {}
    for i, p in enumerate(params):
        assert engine.block_pool.reset_prefix_cache()
        engine.add_request(f"alone-{i}", prompt, p)
        out[f"c{i}"] = tokens(run(engine)[f"alone-{i}"])
    return out


@pytest.mark.slow
def test_greedy_choices_compute_the_prompt_once_and_share_its_full_blocks(default_model):
    engine = default_model
    prompt = _prompt(engine)
    full, n = len(prompt) // BS, 3
    params = [SamplingParams(max_tokens=10, temperature=0)] * n
    alone = _separately(engine, prompt, params[:1])["c0"]
    assert engine.block_pool.reset_prefix_cache()
    before = engine.stats()["prompt_tokens_computed"]

    engine.add_choices(["c0", "c1", "c2"], prompt, params)
    first = engine.step()  # choice 0's prompt, then the fork
    assert engine.stats()["prompt_tokens_computed"] - before == len(prompt)  # once, not n times
    assert sorted(o.request_id for o in first) == ["c0", "c1", "c2"]
    blocks = {rid: list(engine.requests[rid].block_ids) for rid in ("c0", "c1", "c2")}
    shared = blocks["c0"][:full]
    assert all(b[:full] == shared for b in blocks.values())
    assert all(engine.block_pool.ref_counts[b] == n for b in shared)
    partial = [b[full] for b in blocks.values()]
    assert len(set(partial)) == n  # one own block each
    assert engine.block_pool.num_used == full + n
    kv = engine.kv_cache
    filled = len(prompt) % BS
    for b in partial[1:]:  # the copy holds choice 0's prompt KV
        assert torch.equal(kv[b, :, :, :filled], kv[partial[0], :, :, :filled])

    outs = run(engine)
    got = {rid: [t for o in first if o.request_id == rid for t in o.new_token_ids] + tokens(outs[rid])
           for rid in ("c0", "c1", "c2")}
    assert got == {"c0": alone, "c1": alone, "c2": alone}
    assert engine.stats()["prompt_tokens_computed"] - before == len(prompt)
    final = {rid: outs[rid][-1] for rid in got}
    assert final["c0"].num_cached_tokens == 0 and final["c1"].num_cached_tokens == len(prompt)
    assert_no_leaks(engine)


@pytest.mark.slow
def test_seeded_choice_i_equals_a_request_seeded_seed_plus_i_alone(default_model):
    engine = default_model
    prompt = _prompt(engine, 12)
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=40 + i, logprobs=0) for i in range(3)]
    alone = _separately(engine, prompt, params)
    assert len(set(map(tuple, alone.values()))) > 1  # three seeds, three samples
    assert engine.block_pool.reset_prefix_cache()
    engine.add_choices(list(alone), prompt, params)
    outs = run(engine)
    assert {rid: tokens(o) for rid, o in outs.items()} == alone
    assert all(len(o[0].logprobs) == 1 for o in outs.values())  # the forked first token has its logprob too
    assert_no_leaks(engine)


@pytest.mark.slow
def test_today_a_request_per_choice_recomputes_the_partial_block(default_model):
    """The contrast the fork removes: separate requests hit the full blocks and compute the rest each."""
    engine = default_model
    prompt = _prompt(engine)
    assert engine.block_pool.reset_prefix_cache()
    before = engine.stats()["prompt_tokens_computed"]
    for i in range(3):
        engine.add_request(f"sep-{i}", prompt, SamplingParams(max_tokens=2, temperature=0))
    run(engine)
    assert engine.stats()["prompt_tokens_computed"] - before == len(prompt) + 2 * (len(prompt) % BS)
    assert_no_leaks(engine)


def _tiny_prompt() -> list[int]:
    return list(range(5, 5 + 2 * BS + 5))


def test_a_choice_aborted_before_the_fork_is_dropped_and_the_rest_run(tiny_engine):
    engine = tiny_engine()
    engine.add_choices(["a", "b", "c"], _tiny_prompt(), [SamplingParams(max_tokens=4, temperature=0)] * 3)
    assert engine.abort("b")
    outs = run(engine)
    assert outs["b"][-1].finish_reason == "abort" and len(tokens(outs["b"])) == 0
    assert tokens(outs["a"]) == tokens(outs["c"]) and len(tokens(outs["a"])) == 4
    assert_no_leaks(engine)


def test_choice_0_aborted_before_its_prompt_is_done_leaves_the_others_to_run_alone(tiny_engine):
    engine = tiny_engine(long_prefill_chunk=BS)  # the prompt takes three steps
    p = SamplingParams(max_tokens=4, temperature=0)
    engine.add_choices(["a", "b", "c"], _tiny_prompt(), [p] * 3)
    engine.step()
    assert engine.abort("a")
    outs = run(engine)
    assert outs["a"][-1].finish_reason == "abort"
    engine.add_request("ref", _tiny_prompt(), p)
    ref = tokens(run(engine)["ref"])
    assert tokens(outs["b"]) == tokens(outs["c"]) == ref
    assert_no_leaks(engine)


def test_choices_ending_at_different_times_and_one_cancelled_mid_decode_free_every_block(tiny_engine):
    engine = tiny_engine()
    params = [SamplingParams(max_tokens=1, temperature=0), SamplingParams(max_tokens=30, temperature=0),
              SamplingParams(max_tokens=6, temperature=0)]
    engine.add_choices(["a", "b", "c"], _tiny_prompt(), params)
    first = engine.step()
    assert [o.finished for o in first if o.request_id == "a"] == [True]  # choice 0 done on its first token
    used = engine.block_pool.num_used
    assert used == 2 + 2  # the shared full blocks (still held by b and c) and b's and c's own copies
    engine.step()
    assert engine.abort("b")
    outs = run(engine)
    assert outs["c"][-1].num_output_tokens == 6 and outs["c"][-1].finish_reason == "length"
    assert outs["b"][-1].finish_reason == "abort"
    assert_no_leaks(engine)


def test_no_free_block_for_the_copy_runs_the_choice_as_an_ordinary_request(tiny_engine):
    engine = tiny_engine(num_blocks=5)  # 4 usable: choice 0's 3 and one copy, no room for a second
    p = SamplingParams(max_tokens=2, temperature=0)
    engine.add_choices(["a", "b", "c"], _tiny_prompt(), [p] * 3)
    outs = run(engine)
    assert tokens(outs["a"]) == tokens(outs["b"]) == tokens(outs["c"])
    assert_no_leaks(engine)


def test_choices_fork_off_the_right_logits_row_while_other_requests_verify_drafts(tiny_engine):
    """A step where choice 0's prompt ends beside requests verifying drafts (several logits rows each, before
    choice 0's): the choices still sample from choice 0's row, so they equal a request alone."""
    from services.config import SpeculativeConfig

    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine = tiny_engine(speculative=SpeculativeConfig(num_speculative_tokens=5, min_acceptance=0))
    propose = engine.speculator.propose
    verified = []

    def always_draft(running):  # the n-gram proposer finds little in a random model's output: draft anyway
        propose(running)
        verified.append([])
        for req in running:
            if req.request_id.startswith("busy") and req.num_tokens - req.num_computed_tokens == 1:
                req.spec_token_ids = req.spec_token_ids or [7, 8, 9]
                verified[-1].append(req.request_id)

    engine.speculator.propose = always_draft
    for i in range(3):
        engine.add_request(f"busy{i}", [30 + i] * 20, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    engine.step()  # their prompts: they verify drafts from the next step on
    engine.add_choices(["a", "b", "c"], _tiny_prompt(), [greedy] * 3)
    verified.clear()
    outs = run(engine)
    assert len(verified[0]) == 3  # every busy request verified drafts in the step choice 0's prompt ran
    reference = tiny_engine()
    reference.add_request("ref", _tiny_prompt(), greedy)
    ref = tokens(run(reference)["ref"])
    assert tokens(outs["a"]) == tokens(outs["b"]) == tokens(outs["c"]) == ref
    assert_no_leaks(engine)


@pytest.mark.slow
def test_disaggregated_choices_prefill_once_send_the_kv_once_and_fork_on_the_decode_side(default_model):
    """Prefill engine: the prompt once, every choice's first token from choice 0's row; the KV of choice 0
    alone moves to the decode engine, which forks the other choices off it. Outputs equal each seeded
    choice handed off alone, as today's one request per choice is."""
    from services.config import EngineConfig
    from services.engine.engine import Engine
    from tests.engine.conftest import DEFAULT_KV_BYTES
    from tests.engine.test_disagg_lifecycle import copy_blocks, handoff

    prefill, decode = default_model, Engine(EngineConfig(dtype="fp32", kv_cache_bytes=DEFAULT_KV_BYTES))
    prompt = _prompt(prefill, 12)
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=70 + i, logprobs=0) for i in range(3)]
    ids = ["a", "b", "c"]
    want = {rid: handoff(prefill, decode, rid, prompt, p) for rid, p in zip(ids, params)}
    assert len(set(map(tuple, want.values()))) > 1
    assert prefill.block_pool.reset_prefix_cache() and decode.block_pool.reset_prefix_cache()
    before = prefill.stats()["prompt_tokens_computed"]

    dst = decode.reserve("a", prompt, params[0])  # one reservation: the KV travels once
    prefill.add_choices(ids, prompt, params, prefill_only=True)
    first = {o.request_id: o for o in prefill.step() if o.finished}
    assert sorted(first) == ids and {o.finish_reason for o in first.values()} == {"prefilled"}
    assert prefill.stats()["prompt_tokens_computed"] - before == len(prompt)
    assert not first["b"].block_ids and not first["c"].block_ids  # only choice 0 holds KV
    assert prefill.block_pool.num_used == len(first["a"].block_ids) == len(dst)
    copy_blocks(prefill, first["a"].block_ids, decode, dst)
    prefill.release("a")
    decode.start_decode("a", first["a"].new_token_ids[0], first["a"].logprobs[0], choices=[
        (rid, p, first[rid].new_token_ids[0], first[rid].logprobs[0]) for rid, p in zip(ids[1:], params[1:])])
    assert decode.block_pool.num_used == len(prompt) // BS + 3  # shared full blocks + one partial block each
    outs = run(decode)
    assert {rid: tokens(outs[rid]) for rid in ids} == want
    assert decode.stats()["prompt_tokens_computed"] == 0
    assert_no_leaks(prefill)
    assert_no_leaks(decode)


def test_prefill_only_choices_end_with_an_aborted_choice_0(tiny_engine):
    engine = tiny_engine(long_prefill_chunk=BS)
    engine.add_choices(["a", "b"], _tiny_prompt(), [SamplingParams(max_tokens=4)] * 2, prefill_only=True)
    engine.step()
    assert engine.abort("a")
    outs = run(engine)
    assert outs["b"][-1].finish_reason == "abort"
    assert_no_leaks(engine)


def test_a_bad_decoded_choice_refuses_them_all_and_keeps_the_reservation(tiny_engine):
    from services.errors import InvalidRequestError

    engine = tiny_engine()
    p = SamplingParams(max_tokens=4)
    engine.reserve("a", _tiny_prompt(), p)
    engine.add_request("busy", [1, 2, 3], p)
    for bad in ([("b", p, 7, None), ("busy", p, 8, None)], [("b", p, 7, None), ("c", SamplingParams(max_tokens=4, lora="nope"), 7, None)]):
        with pytest.raises(InvalidRequestError):
            engine.start_decode("a", 5, choices=bad)
        assert "b" not in engine.requests and engine.requests["a"].status.value == "reserved"
    engine.release("a")
    run(engine)
    assert_no_leaks(engine)
