"""Disaggregation hooks: prefill-only in one engine, decode from transferred blocks in
another. Every path ends with a leak check: all blocks free again."""

from __future__ import annotations

import pytest
import torch

from services.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams
from services.errors import CapacityError, InvalidRequestError
from tests.engine.recording import run_to_completion


def copy_blocks(src: Engine, src_blocks: list[int], dst: Engine, dst_blocks: list[int]) -> None:
    """Stand-in for kvtransfer inside one process: whole blocks, every layer."""
    dst.kv_cache[torch.tensor(dst_blocks)] = src.kv_cache[torch.tensor(src_blocks)]


def handoff(prefill: Engine, decode: Engine, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    dst = decode.reserve(rid, prompt, params)
    prefill.add_request(rid, prompt, params, prefill_only=True)
    progress = []
    while True:
        outs = [o for o in prefill.step() if o.request_id == rid]
        progress += outs
        if outs and outs[-1].finished:
            break
    last = progress[-1]
    assert last.finish_reason == "prefilled" and len(last.new_token_ids) == 1
    assert len(last.block_ids) == len(dst)
    copy_blocks(prefill, last.block_ids, decode, dst)
    prefill.release(rid)
    decode.start_decode(rid, last.new_token_ids[0])
    outs = run_to_completion(decode)[rid]
    return [t for o in outs for t in o.new_token_ids]


def assert_no_leaks(*engines: Engine) -> None:
    for e in engines:
        assert e.block_pool.num_used == 0, f"{e.block_pool.num_used} blocks still held"
        assert not e.requests


@pytest.mark.slow
def test_handoff_matches_single_engine():
    cfg = EngineConfig(dtype="fp32", long_prefill_chunk=48, max_num_batched_tokens=64)
    prefill, decode, single = Engine(cfg), Engine(cfg), Engine(cfg)
    tok = single.tokenizer
    params = SamplingParams(max_tokens=12, temperature=0)
    for rid, text in [("a", "The capital of France is"),
                      ("b", "A list of the planets of the solar system, in order from the sun: " * 3)]:
        prompt = tok.encode(text)
        single.add_request(rid, prompt, params)
        want = [t for o in run_to_completion(single)[rid] for t in o.new_token_ids]
        assert handoff(prefill, decode, rid, prompt, params) == want
    assert_no_leaks(prefill, decode, single)


@pytest.fixture
def pair():
    cfg = EngineConfig(model="dummy:tiny", dtype="fp32", kv_cache_bytes=256 * 1024, long_prefill_chunk=16,
                       max_num_batched_tokens=32)
    return Engine(cfg), Engine(cfg)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
    # seeded: the first token is drawn on the prefill side; the decode side's draws must go on from there
    # (one random stream per seed), not start the seed's stream over and repeat its first draw
    SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_handoff_on_tiny_model_matches_single_engine(pair, params):
    prefill, decode = pair
    prompt = list(range(3, 60))
    single = Engine(prefill.config)
    single.add_request("x", prompt, params)
    want = [t for o in run_to_completion(single)["x"] for t in o.new_token_ids]
    assert handoff(prefill, decode, "x", prompt, params) == want
    assert_no_leaks(prefill, decode)


def test_prefill_progress_reports_blocks_as_chunks_finish(pair):
    prefill, _ = pair
    prefill.add_request("p", list(range(3, 60)), SamplingParams(max_tokens=4), prefill_only=True)
    computed = []
    while prefill.has_unfinished():
        for o in prefill.step():
            computed.append(o.num_computed_tokens)
            assert o.block_ids  # the caller can ship these blocks now
    assert computed == sorted(computed) and len(computed) >= 3 and computed[-1] == 57
    assert prefill.block_pool.num_used > 0  # held for the caller until release
    prefill.release("p")
    assert_no_leaks(prefill)


def test_abort_mid_prefill_frees_blocks(pair):
    prefill, _ = pair
    prefill.add_request("p", list(range(3, 60)), SamplingParams(max_tokens=4), prefill_only=True)
    prefill.step()
    assert prefill.block_pool.num_used > 0
    assert prefill.abort("p")
    outs = run_to_completion(prefill)
    assert outs["p"][-1].finish_reason == "abort"
    assert_no_leaks(prefill)


def test_abort_after_prefill_before_release_frees_blocks(pair):
    prefill, _ = pair
    prefill.add_request("p", list(range(3, 30)), SamplingParams(max_tokens=4), prefill_only=True)
    run_to_completion(prefill)
    assert prefill.abort("p")
    run_to_completion(prefill)
    assert_no_leaks(prefill)


def test_reservation_released_or_aborted_without_kv(pair):
    _, decode = pair
    decode.reserve("r1", list(range(3, 40)), SamplingParams())
    decode.reserve("r2", list(range(3, 40)), SamplingParams())
    assert decode.block_pool.num_used == 6
    decode.release("r1")
    decode.abort("r2")
    run_to_completion(decode)
    assert_no_leaks(decode)


def test_abort_mid_decode_frees_blocks(pair):
    prefill, decode = pair
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    prompt = list(range(3, 40))
    decode.reserve("d", prompt, params)
    decode.start_decode("d", 7)
    decode.step()
    decode.step()
    assert decode.abort("d")
    assert run_to_completion(decode)["d"][-1].finish_reason == "abort"
    assert_no_leaks(decode)


def test_first_token_can_finish_the_request(pair):
    _, decode = pair
    eos = decode.eos_token_ids[0]
    decode.reserve("e", list(range(3, 20)), SamplingParams(max_tokens=10))
    decode.start_decode("e", eos)
    outs = run_to_completion(decode)["e"]
    assert outs[-1].finished and outs[-1].finish_reason == "stop" and outs[-1].new_token_ids == [eos]
    assert_no_leaks(decode)


def test_reserve_without_room_is_a_capacity_error_and_leaks_nothing(pair):
    _, decode = pair
    total = decode.block_pool.num_usable
    with pytest.raises((CapacityError, InvalidRequestError)):
        decode.reserve("big", list(range(3, 3 + (total + 1) * 16)), SamplingParams())
    held = decode.reserve("fits", list(range(3, 3 + (total - 1) * 16)), SamplingParams())
    with pytest.raises(CapacityError, match="no room"):
        decode.reserve("second", list(range(3, 3 + 3 * 16)), SamplingParams())
    assert len(held) == total - 1
    decode.release("fits")
    assert_no_leaks(decode)


def test_start_decode_without_reservation_is_rejected(pair):
    _, decode = pair
    with pytest.raises(InvalidRequestError, match="no reservation"):
        decode.start_decode("nope", 5)
    assert_no_leaks(decode)


def _prefill_into(prefill: Engine, decode: Engine, rid: str, prompt: list[int], params: SamplingParams) -> None:
    """Reserve on ``decode``, prefill on ``prefill``, copy the KV, start decoding: the worker's hand-off."""
    dst = decode.reserve(rid, prompt, params)
    prefill.add_request(rid, prompt, params, prefill_only=True)
    last = None
    while last is None or not last.finished:
        last = next((o for o in prefill.step() if o.request_id == rid), last)
    copy_blocks(prefill, last.block_ids, decode, dst)
    prefill.release(rid)
    decode.start_decode(rid, last.new_token_ids[0])


def test_decode_after_remote_prefill_runs_at_most_max_num_seqs():
    cfg = EngineConfig(model="dummy:tiny", dtype="fp32", kv_cache_bytes=256 * 1024, max_num_seqs=2)
    prefill, decode, single = Engine(cfg), Engine(cfg), Engine(cfg)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = {f"r{i}": list(range(3 + i, 40 + i)) for i in range(5)}
    want = {}
    for rid, prompt in prompts.items():
        single.add_request(rid, prompt, params)
        want[rid] = [t for o in run_to_completion(single)[rid] for t in o.new_token_ids]
        _prefill_into(prefill, decode, rid, prompt, params)
    assert decode.scheduler.num_running == 2 and decode.scheduler.num_waiting == 3
    got = {rid: [] for rid in prompts}
    for o in decode.take_pending_outputs():  # the first tokens, from the prefill side
        got[o.request_id] += o.new_token_ids
    most = 0
    while decode.has_unfinished():
        outs = decode.step()
        most = max(most, len(outs))
        assert decode.scheduler.num_running <= 2
        for o in outs:
            got[o.request_id] += o.new_token_ids
    assert most == 2  # the rest waited for a slot, holding their blocks
    assert got == want
    assert_no_leaks(prefill, decode)


def test_a_request_waiting_for_a_decode_slot_can_be_aborted():
    cfg = EngineConfig(model="dummy:tiny", dtype="fp32", kv_cache_bytes=256 * 1024, max_num_seqs=1)
    prefill, decode = Engine(cfg), Engine(cfg)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for rid in ("a", "b"):
        _prefill_into(prefill, decode, rid, list(range(3, 30)), params)
    decode.step()
    assert decode.scheduler.num_running == 1 and decode.scheduler.num_waiting == 1  # "a" runs, "b" waits
    assert decode.abort("b")
    outs = run_to_completion(decode)
    assert outs["b"][-1].finish_reason == "abort"
    assert outs["a"][-1].finish_reason == "length"
    assert_no_leaks(prefill, decode)
