"""Greedy tokens and per-step logits equal HF transformers (fp32, same weights) for
prompts of mixed lengths run concurrently in one engine, with chunked prefill
and prefix-cache hits happening."""

from __future__ import annotations

import pytest
import torch

from services.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams
from tests.engine.recording import Recorder, run_to_completion

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a meticulous assistant for a public library. You answer questions about opening hours, "
    "borrowing rules, late fees, room bookings and the catalogue. Opening hours: Monday to Friday from nine "
    "in the morning until eight in the evening, Saturday from ten until five, closed on Sunday. Members may "
    "borrow up to twelve items at once for three weeks; renewals are allowed twice unless someone else has "
    "reserved the item. Late fees are twenty cents per day per item, capped at five dollars. Study rooms can "
    "be booked for two hours per day through the front desk. The catalogue lists books, films, music and "
    "board games; children's items are on the ground floor and reference works on the second floor. "
) * 2
QUESTIONS = [
    "Question: On which day is the library closed? Answer:",
    "Question: How many items can a member borrow? Answer:",
    "Question: What is the late fee per day? Answer:",
]
OTHERS = [
    "The capital of France is",
    "def fibonacci(n):",
    "import numpy as np\nimport",
    "Water boils at a temperature of",
    "1, 2, 3, 4, 5,",
    "The first three planets from the sun are Mercury,",
    "In 1969, Neil Armstrong became the first person to",
    "Here is a list of primary colors: red,",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(dtype="fp32", max_num_batched_tokens=160, long_prefill_chunk=64))


def test_concurrent_greedy_matches_hf(engine):
    from transformers import AutoModelForCausalLM

    tok = engine.tokenizer
    prompts = {f"shared-{i}": tok.encode(SYSTEM + q) for i, q in enumerate(QUESTIONS)}
    prompts.update({f"other-{i}": tok.encode(p) for i, p in enumerate(OTHERS)})
    assert len(prompts) >= 8 and len(prompts["shared-0"]) > 256
    rec = Recorder(engine)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)

    # The first shared-prefix prompt goes alone until its prefill is done, so its
    # blocks are cached; everything else then joins while it is still decoding.
    engine.add_request("shared-0", prompts["shared-0"], params)
    first = []
    while not first:
        first = engine.step()
    for rid, ids in prompts.items():
        if rid != "shared-0":
            engine.add_request(rid, ids, params)
    outs = run_to_completion(engine)
    outs["shared-0"][:0] = first

    got = {rid: [t for o in outs[rid] for t in o.new_token_ids] for rid in prompts}
    final = {rid: outs[rid][-1] for rid in prompts}
    # chunked prefill happened: the first long prompt was split into several steps
    assert len([n for n in rec.scheduled["shared-0"] if n > 1]) >= len(prompts["shared-0"]) // 64
    # and steps mixed single-token decodes with prefill chunks
    assert any(1 in step and any(n > 1 for n in step) for step in rec.steps)
    # prefix-cache hits happened for the later shared-prefix prompts
    assert all(final[f"shared-{i}"].num_cached_tokens >= 256 for i in (1, 2))
    assert engine.block_pool.num_used == 0  # every block free again

    hf = AutoModelForCausalLM.from_pretrained(engine.source.weights_dir, dtype=torch.float32).eval()
    for rid, ids in prompts.items():
        ref, ref_logits = hf_greedy(hf, ids, MAX_TOKENS)
        assert got[rid] == ref, f"{rid}: pdserve {got[rid]} != HF {ref}"
        ours = torch.stack(rec.logits[rid])
        torch.testing.assert_close(ours, ref_logits, atol=2e-3, rtol=1e-4)
        top2 = ref_logits.topk(2).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-2, f"{rid} has a near tie; pick another prompt"


@torch.inference_mode()
def hf_greedy(hf, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """HF's own incremental greedy loop (its KV cache), EOS not special: tokens and per-step logits."""
    out = hf(torch.tensor([ids]), use_cache=True)
    tokens, logits = [], []
    for _ in range(n):
        step_logits = out.logits[0, -1].float()
        logits.append(step_logits)
        tokens.append(int(step_logits.argmax()))
        out = hf(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, torch.stack(logits)


def test_default_bf16_path_matches_hf_bf16_up_to_near_ties():
    """The default path (bf16 weights and KV, the CPU kernels at this CPU's level: AMX tiles for
    prefill here) against HF transformers in bf16 (oneDNN), all prompts batched on our side.

    Near-tie rule (tests/kernels/greedy_match.py): two bf16 implementations round differently
    (other kernels, other summation orders), so the first token that differs must be one where
    HF's top two logits are within 8 bf16 steps of its top logit (0.5 at a logit of 16-32);
    the rest of that request is then not compared (from there on the two condition on
    different tokens). Every other token must be identical."""
    from transformers import AutoModelForCausalLM

    from tests.kernels.greedy_match import assert_same_greedy

    engine = Engine(EngineConfig(kv_cache_bytes=64 << 20))  # the default: bf16, kernels auto
    assert engine.config.dtype == "bfloat16"
    tok = engine.tokenizer
    prompts = {f"p{i}": tok.encode(p) for i, p in enumerate(OTHERS + [SYSTEM + QUESTIONS[0]])}
    assert len(prompts) >= 8
    rec = Recorder(engine)
    n = 24
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    outs = run_to_completion(engine)
    got = {rid: [t for o in outs[rid] for t in o.new_token_ids] for rid in prompts}
    assert engine.block_pool.num_used == 0

    hf = AutoModelForCausalLM.from_pretrained(engine.source.weights_dir, dtype=torch.bfloat16).eval()
    ref, ref_logits = {}, {}
    for rid, ids in prompts.items():
        ref[rid], logits = hf_greedy(hf, ids, n)
        ref_logits[rid] = list(logits)
    assert_same_greedy(got, ref, ref_logits, rec.logits, "bfloat16")
    # not vacuous: most tokens were compared and equal (a tie ends a request's comparison early)
    same = sum(next((i for i, (g, r) in enumerate(zip(got[k], ref[k])) if g != r), n) for k in prompts)
    assert same >= 0.6 * n * len(prompts), f"only {same} of {n * len(prompts)} tokens before the first tie"
