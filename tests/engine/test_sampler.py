"""Sampling: greedy, seeds, temperature, top-k/top-p/min-p, penalties, logprobs,
and the finish reasons a client sees.

The Sampler is driven directly with chosen logits where the property is about
the distribution; the engine (dummy:tiny, and the real model where a trained
distribution matters) where it is about what a request returns.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from services.engine.request import Request
from services.engine.sampler import Sampler
from services.engine.sampling_params import SamplingParams
from services.errors import InvalidRequestError
from tests.engine.checks import assert_no_leaks, generate, run, text, tokens

VOCAB = 64


def req(rid: str = "r", prompt=(3,), output=(), **params) -> Request:
    r = Request(rid, list(prompt), SamplingParams(**params))
    for t in output:
        r.append_output(t)
    return r


def draw(logits: torch.Tensor, reqs: list[Request], sampler: Sampler | None = None) -> list[int]:
    return (sampler or Sampler())(logits.clone(), reqs).token_ids


def counts(dist: list[float], n: int, **params) -> Counter:
    """Token frequencies of ``n`` seeded draws from ``dist`` (probabilities)."""
    logits = torch.log(torch.tensor([dist]))
    sampler = Sampler()
    r = req(seed=7, **params)
    return Counter(draw(logits, [r], sampler)[0] for _ in range(n))


# ---- greedy and its equivalents ---------------------------------------------------------------


def test_greedy_is_argmax():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    reqs = [req(str(i), temperature=0) for i in range(6)]
    assert draw(logits, reqs) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)],
                         ids=["top_k=1", "tiny-top_p", "min_p=1"])
def test_truncation_to_one_token_equals_greedy(params):
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(1)) * 0.5  # flat: sampling would vary
    reqs = [req(str(i), temperature=1.0, **params) for i in range(8)]
    for _ in range(5):
        assert draw(logits, reqs) == logits.argmax(-1).tolist()


def test_unseeded_sampling_varies():
    logits = torch.zeros(1, VOCAB)
    seen = {draw(logits, [req(temperature=1.0)])[0] for _ in range(30)}
    assert len(seen) > 5


def test_low_temperature_concentrates_on_the_top_token():
    dist = [0.4, 0.3, 0.2, 0.1]
    hot, cold = counts(dist, 300, temperature=1.0), counts(dist, 300, temperature=0.02)
    assert hot[0] < 200 and len(hot) == 4
    assert cold[0] == 300  # p(1) / p(0) = (3/4)^50 at T=0.02


# ---- truncation ------------------------------------------------------------------------------

DIST = [0.5, 0.3, 0.15, 0.05]


def test_untruncated_sampling_reaches_the_tail():
    c = counts(DIST, 400, temperature=1.0)
    assert set(c) == {0, 1, 2, 3}
    assert c[0] > c[1] > c[2] > c[3]


@pytest.mark.parametrize("params, kept", [
    (dict(top_k=2), {0, 1}),
    (dict(top_k=3), {0, 1, 2}),
    (dict(top_p=0.7), {0, 1}),  # 0.5 < 0.7: the second token is needed to reach the mass
    (dict(top_p=0.45), {0}),
    (dict(min_p=0.5), {0, 1}),  # floor 0.25
    (dict(min_p=0.2), {0, 1, 2}),  # floor 0.1
])
def test_truncation_keeps_exactly_the_allowed_tokens(params, kept):
    assert set(counts(DIST, 400, temperature=1.0, **params)) == kept


def test_min_p_scales_with_the_top_probability():
    # the same min_p keeps more tokens when the top token is less certain
    peaked = counts([0.9, 0.05, 0.03, 0.02], 400, temperature=1.0, min_p=0.1)
    flat = counts([0.3, 0.25, 0.25, 0.2], 400, temperature=1.0, min_p=0.1)
    assert set(peaked) == {0} and set(flat) == {0, 1, 2, 3}


# ---- seeds -----------------------------------------------------------------------------------


def test_seeded_draws_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, VOCAB, generator=gen) * 0.3
    alone_sampler, batch_sampler = Sampler(), Sampler()
    alone, batched = [], []
    for _ in range(20):
        target = req("target", temperature=1.0, seed=42)
        alone += draw(logits[2:3], [target], alone_sampler)
        batch = [req("a", temperature=1.0), req("b", temperature=0.7, seed=1), req("target", temperature=1.0, seed=42),
                 req("c", temperature=0)]
        batched.append(draw(logits, batch, batch_sampler)[2])
    assert alone == batched
    assert len(set(alone)) > 3  # the draws are random, not stuck on one token


# ---- penalties -------------------------------------------------------------------------------


def two_way(a: float, b: float) -> torch.Tensor:
    """Logits where token 0 scores ``a``, token 1 scores ``b`` and the rest are far below."""
    logits = torch.full((1, VOCAB), -20.0)
    logits[0, 0], logits[0, 1] = a, b
    return logits


@pytest.mark.parametrize("a, b", [(2.0, 1.5), (-1.0, -1.2)], ids=["positive", "negative"])
def test_repetition_penalty_discourages_prompt_and_output_tokens(a, b):
    # token 0 leads; once it has appeared (in the prompt or the output) a penalty of 1.5 lets token 1 win
    assert draw(two_way(a, b), [req(prompt=[5], temperature=0)]) == [0]
    assert draw(two_way(a, b), [req(prompt=[0], temperature=0, repetition_penalty=1.5)]) == [1]
    assert draw(two_way(a, b), [req(prompt=[5], output=[0], temperature=0, repetition_penalty=1.5)]) == [1]
    # below 1 it encourages repetition instead
    assert draw(two_way(b, a), [req(prompt=[0], temperature=0, repetition_penalty=0.5)]) == [0]


def test_presence_penalty_applies_once_per_output_token():
    logits = two_way(2.0, 1.5)
    assert draw(logits, [req(output=[0], temperature=0, presence_penalty=1.0)]) == [1]
    assert draw(logits, [req(output=[0], temperature=0, presence_penalty=0.4)]) == [0]
    assert draw(logits, [req(output=[0, 0, 0], temperature=0, presence_penalty=0.4)]) == [0]  # not per count
    assert draw(logits, [req(prompt=[0], temperature=0, presence_penalty=1.0)]) == [0]  # prompt tokens don't count
    assert draw(two_way(1.5, 2.0), [req(output=[0], temperature=0, presence_penalty=-1.0)]) == [0]


def test_frequency_penalty_grows_with_the_count():
    logits = two_way(2.0, 1.5)
    assert draw(logits, [req(output=[0], temperature=0, frequency_penalty=0.2)]) == [0]  # 2.0 - 0.2
    assert draw(logits, [req(output=[0, 0, 0], temperature=0, frequency_penalty=0.2)]) == [1]  # 2.0 - 0.6
    assert draw(logits, [req(prompt=[0, 0, 0], temperature=0, frequency_penalty=0.2)]) == [0]


def test_penalties_shift_the_sampling_distribution():
    def share_of_repeats(**penalty) -> float:
        sampler = Sampler()
        r = req(output=[0, 1, 2], temperature=1.0, seed=3, **penalty)
        drawn = [draw(torch.zeros(1, VOCAB), [r], sampler)[0] for _ in range(1000)]
        return sum(t in (0, 1, 2) for t in drawn) / len(drawn)

    # flat logits: the 3 generated tokens hold 3/64 of the mass, 3e^-2 / (61 + 3e^-2) with presence 2
    assert share_of_repeats() > 0.02
    assert share_of_repeats(presence_penalty=2.0) < share_of_repeats() / 3
    assert share_of_repeats(frequency_penalty=2.0) < share_of_repeats() / 3
    assert share_of_repeats(presence_penalty=-2.0) > 0.15  # e^2 times the mass: about 27%


# ---- logprobs --------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=0.7, top_k=5, repetition_penalty=1.3,
                                                              presence_penalty=0.5, seed=1)],
                         ids=["greedy", "sampled-with-penalties"])
def test_logprobs_are_of_the_raw_distribution(params):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4)) * 3
    expected = logits.log_softmax(-1)
    reqs = [req(str(i), prompt=[1, 2, 3], output=[4], logprobs=n, **params) for i, n in enumerate((0, 5, 20))]
    out = Sampler()(logits.clone(), reqs)
    for i, n in enumerate((0, 5, 20)):
        lp = out.logprobs[i]
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(expected[i, lp.token_id].item(), abs=1e-5)
        assert len(lp.top) == n
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True)
        if n:
            top_vals, top_ids = expected[i].topk(n)
            assert [t for t, _ in lp.top] == top_ids.tolist()
            assert vals == pytest.approx(top_vals.tolist(), abs=1e-5)


def test_no_logprobs_unless_asked():
    out = Sampler()(torch.randn(2, VOCAB), [req("a", temperature=0), req("b", temperature=0, logprobs=2)])
    assert out.logprobs[0] is None and out.logprobs[1] is not None


# ---- parameter validation --------------------------------------------------------------------


@pytest.mark.parametrize("bad, param", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"), (dict(presence_penalty=3), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(logprobs=21), "logprobs"), (dict(stop=[""]), "stop"), (dict(seed=1.5), "seed"),
])
def test_bad_sampling_params_name_the_parameter(bad, param):
    with pytest.raises(InvalidRequestError, match=param) as err:
        SamplingParams(**bad)
    assert err.value.param == param


@pytest.mark.parametrize("bad, param", [
    (dict(temperature="hot"), "temperature"), (dict(top_p=None), "top_p"), (dict(stop=5), "stop"),
    (dict(max_tokens=True), "max_tokens"), (dict(stop_token_ids=[1.5]), "stop_token_ids"),
])
def test_wrongly_typed_sampling_params_name_the_parameter(bad, param):
    with pytest.raises(InvalidRequestError, match=param) as err:
        SamplingParams(**bad)
    assert err.value.param == param


# ---- through the engine ----------------------------------------------------------------------


def spy_logits(engine) -> list[torch.Tensor]:
    """From now on, a copy of the logits the engine's sampler receives, per step."""
    seen = []
    sampler = engine.sampler

    class Spy:
        def __getattr__(self, name):
            return getattr(sampler, name)

        def __call__(self, logits, reqs):
            seen.append(logits.clone())
            return sampler(logits, reqs)

    engine.sampler = Spy()
    return seen


def test_seeded_request_is_reproducible_and_independent_of_its_batch(tiny_engine):
    engine = tiny_engine()
    prompt = list(range(10, 30))
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)

    alone = tokens(generate(engine, {"s": prompt}, seeded)["s"])
    again = tokens(generate(engine, {"s": prompt}, seeded)["s"])
    others = {"o1": (list(range(40, 47)), SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)),
              "o2": (prompt, SamplingParams(max_tokens=5, temperature=0.8, seed=99, ignore_eos=True)),
              "o3": (list(range(100, 160)), SamplingParams(max_tokens=15, temperature=0, ignore_eos=True))}
    engine.add_request("o1", *others["o1"])  # already decoding when the seeded request joins
    first = engine.step()
    engine.add_request("o2", *others["o2"])
    engine.add_request("s", prompt, seeded)
    engine.add_request("o3", *others["o3"])
    outs = run(engine)
    outs["o1"][:0] = first

    assert alone == again
    assert tokens(outs["s"]) == alone
    assert tokens(outs["o2"]) != alone[:5]  # same prompt, another seed
    other_seed = SamplingParams(max_tokens=12, temperature=1.0, seed=4321, ignore_eos=True)
    assert tokens(generate(engine, {"s": prompt}, other_seed)["s"]) != alone
    assert_no_leaks(engine)


def test_unseeded_requests_vary(tiny_engine):
    engine = tiny_engine()
    params = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    outs = generate(engine, {"a": [7] * 12, "b": [7] * 12}, params)
    assert tokens(outs["a"]) != tokens(outs["b"])
    assert_no_leaks(engine)


def test_engine_logprobs_match_the_model_logits(tiny_engine):
    engine = tiny_engine()
    seen = spy_logits(engine)
    outs = generate(engine, {"r": list(range(20, 40))},
                    SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3))
    lps = [lp for o in outs["r"] for lp in (o.logprobs or [])]
    assert len(lps) == len(seen) == 4
    for lp, logits in zip(lps, seen):
        raw = logits[0].log_softmax(-1)
        assert lp.logprob == pytest.approx(raw[lp.token_id].item(), abs=1e-5)
        assert [t for t, _ in lp.top] == raw.topk(3).indices.tolist()
    assert tokens(outs["r"]) == [lp.token_id for lp in lps]
    assert_no_leaks(engine)


@pytest.mark.parametrize("penalty", [dict(repetition_penalty=2.0), dict(presence_penalty=2.0),
                                     dict(frequency_penalty=2.0)], ids=lambda p: next(iter(p)))
def test_penalised_requests_run_in_the_engine(tiny_engine, penalty):
    engine = tiny_engine()
    seen = spy_logits(engine)
    prompt = list(range(10, 50))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **penalty)
    outs = generate(engine, {"plain": prompt}, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    seen.clear()
    outs.update(generate(engine, {"penalised": prompt}, params))

    plain, got = tokens(outs["plain"]), tokens(outs["penalised"])
    assert len(got) == 24 and outs["penalised"][-1].finish_reason == "length"
    # each token is the argmax of the model's logits after the documented penalty
    for i, logits in enumerate(seen):
        expected = penalise(logits[0], prompt, got[:i], **penalty).argmax().item()
        assert got[i] == expected
    assert got != plain  # and the penalty changed the output
    assert max(Counter(got).values()) <= max(Counter(plain).values())
    assert_no_leaks(engine)


def penalise(logits: torch.Tensor, prompt: list[int], output: list[int], repetition_penalty: float = 1.0,
             presence_penalty: float = 0.0, frequency_penalty: float = 0.0) -> torch.Tensor:
    """The documented penalties, written out: repetition over prompt + output (divide positive logits,
    multiply negative ones), presence once and frequency per occurrence over the output."""
    out = logits.clone()
    for t in set(prompt + output):
        out[t] = out[t] / repetition_penalty if out[t] > 0 else out[t] * repetition_penalty
    for t, n in Counter(output).items():
        out[t] -= presence_penalty + frequency_penalty * n
    return out


def test_finish_reasons(tiny_engine):
    engine = tiny_engine(max_model_len=40)
    prompt = list(range(50, 70))
    greedy = dict(temperature=0, ignore_eos=True)
    free_run = tokens(generate(engine, {"r": prompt}, SamplingParams(max_tokens=10, **greedy))["r"])

    # max_tokens: exactly that many tokens, "length"
    outs = generate(engine, {"r": prompt}, SamplingParams(max_tokens=3, **greedy))["r"]
    assert (tokens(outs), outs[-1].finish_reason) == (free_run[:3], "length")

    # a stop token ends the request right after its first occurrence, "stop"
    target = free_run[4]
    first = free_run.index(target)
    outs = generate(engine, {"r": prompt}, SamplingParams(max_tokens=10, stop_token_ids=[target], **greedy))["r"]
    assert (tokens(outs), outs[-1].finish_reason) == (free_run[: first + 1], "stop")

    # no max_tokens: generation runs until the context (40 tokens) is full
    outs = generate(engine, {"r": prompt}, SamplingParams(max_tokens=None, **greedy))["r"]
    assert (len(tokens(outs)), outs[-1].finish_reason) == (20, "length")
    assert outs[-1].num_output_tokens == 20 and outs[-1].num_prompt_tokens == 20
    assert_no_leaks(engine)


def test_eos_ends_the_request_unless_ignored(tiny_engine):
    engine = tiny_engine()
    prompt = list(range(60, 80))
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    free_run = tokens(generate(engine, {"r": prompt}, greedy)["r"])
    # dummy:tiny's EOS (1) may never come up greedily: declare the 4th greedy token the EOS, as a
    # model config would, for requests added from now on
    engine.eos_token_ids = (free_run[3],)
    first = free_run.index(free_run[3])

    stopped = generate(engine, {"r": prompt}, SamplingParams(max_tokens=8, temperature=0))["r"]
    assert (tokens(stopped), stopped[-1].finish_reason) == (free_run[: first + 1], "stop")
    ignored = generate(engine, {"r": prompt}, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))["r"]
    assert (tokens(ignored), ignored[-1].finish_reason) == (free_run, "length")
    assert_no_leaks(engine)


# ---- on the real model -----------------------------------------------------------------------


def chat(engine, content: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": content}])


@pytest.mark.slow
def test_real_model_stops_at_end_of_turn_unless_eos_is_ignored(default_model):
    engine = default_model
    prompt = chat(engine, "What is 2+2? Answer with a number only.")
    (eos,) = engine.eos_token_ids

    stopped = generate(engine, {"r": prompt}, SamplingParams(max_tokens=24, temperature=0))["r"]
    got = tokens(stopped)
    assert stopped[-1].finish_reason == "stop" and got[-1] == eos
    assert "<|im_end|>" not in text(stopped) and text(stopped).strip()

    ignored = generate(engine, {"r": prompt}, SamplingParams(max_tokens=len(got) + 3, temperature=0,
                                                             ignore_eos=True))["r"]
    assert ignored[-1].finish_reason == "length"
    assert tokens(ignored)[: len(got)] == got  # the same text, then past the end of turn
    assert_no_leaks(engine)


@pytest.mark.slow
def test_real_model_seeded_sample_is_independent_of_its_batch(default_model):
    engine = default_model
    prompt = chat(engine, "Write a haiku about autumn leaves.")
    seeded = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=2024, ignore_eos=True)
    alone = tokens(generate(engine, {"s": prompt}, seeded)["s"])

    engine.add_request("o1", chat(engine, "Count to five."), SamplingParams(max_tokens=10, temperature=0.8))
    engine.add_request("s", prompt, seeded)
    engine.add_request("o2", prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True))
    outs = run(engine)

    assert tokens(outs["s"]) == alone
    assert tokens(outs["o2"]) != alone
    assert_no_leaks(engine)


@pytest.mark.slow
def test_real_model_penalties_reduce_repetition(default_model):
    engine = default_model
    prompt = engine.tokenizer.encode("yes, yes, yes, yes, yes, yes, yes, yes,")
    (yes,) = engine.tokenizer.encode(" yes")
    params = dict(max_tokens=8, temperature=0, ignore_eos=True)
    plain = tokens(generate(engine, {"r": prompt}, SamplingParams(**params))["r"])
    penalised = tokens(generate(engine, {"r": prompt}, SamplingParams(frequency_penalty=2.0, presence_penalty=2.0,
                                                                      **params))["r"])
    rep = tokens(generate(engine, {"r": prompt}, SamplingParams(repetition_penalty=2.0, **params))["r"])

    assert plain.count(yes) >= 3  # unpenalised, the model continues the pattern
    assert penalised.count(yes) <= 1  # presence/frequency: once generated, " yes" is pushed down
    assert rep.count(yes) < plain.count(yes)  # repetition: " yes" is already in the prompt
    assert_no_leaks(engine)



# ---- logit_bias ------------------------------------------------------------------------------


def test_logit_bias_moves_greedy_and_sampled_choices():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    best = logits.argmax(-1).tolist()
    reqs = [req("g", temperature=0, logit_bias={best[0]: -100, 11: 100}),
            req("s", temperature=1.0, seed=1, logit_bias={str(best[1]): -100, "12": 100})]  # JSON keys too
    for _ in range(20):
        assert draw(logits, reqs) == [11, 12]
    # a small bias shifts the distribution rather than forcing: +ln(4) on token 0 of a uniform pair
    dist = [0.5, 0.5] + [0.0] * (VOCAB - 2)
    seen = counts(dist, 2000, logit_bias={0: 1.3862944})
    assert 0.74 < seen[0] / 2000 < 0.86 and seen[0] + seen[1] == 2000


def test_logit_bias_cannot_unblock_a_forbidden_token():
    logits = torch.zeros(1, VOCAB)
    blocked = torch.ones(1, VOCAB, dtype=torch.bool)
    blocked[0, [4, 5]] = False  # the grammar allows 4 and 5 only
    r = req(temperature=0, logit_bias={9: 100, 5: 3})
    assert Sampler()(logits, [r], blocked).token_ids == [5]


def test_logit_bias_keeps_logprobs_of_the_model():
    """Logprobs report the model's distribution, as with every other sampling setting."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4))
    raw = logits.log_softmax(-1)
    out = Sampler()(logits.clone(), [req(temperature=0, logprobs=0, logit_bias={20: 100})])
    assert out.token_ids == [20] and out.logprobs[0].logprob == pytest.approx(raw[0, 20].item(), abs=1e-5)


@pytest.mark.parametrize("bias, says", [({1: 101}, "[-100, 100]"), ({1: "x"}, "[-100, 100]"), ({-1: 1}, "token ids"),
                                        ({"a": 1}, "token ids"), ({True: 1}, "token ids"), ([1], "object")])
def test_logit_bias_is_validated(bias, says):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(logit_bias=bias)
    assert info.value.param == "logit_bias" and says in info.value.message


def test_engine_refuses_a_logit_bias_outside_the_vocabulary(tiny_engine):
    engine = tiny_engine()
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("r", [1, 2], SamplingParams(logit_bias={10 ** 6: 1}))
    assert info.value.param == "logit_bias" and not engine.requests
