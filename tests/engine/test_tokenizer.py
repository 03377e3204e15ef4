"""Streaming detokenization, stop strings and the chat template on the default
model's real tokenizer (a byte-level BPE: multi-byte characters span tokens)."""

from __future__ import annotations

import pytest

from services.engine.sampling_params import SamplingParams
from services.engine.tokenizer import IncrementalDetokenizer
from services.errors import InvalidRequestError
from tests.engine.checks import assert_no_leaks, generate, text, tokens

MULTI_BYTE = {
    "emoji": "Waving 👋🏽 at the family 👩‍👩‍👧 and a rocket 🚀!",
    "cjk": "你好，世界！日本語のテキストと한국어 문장.",
    "accented": "Café, naïve, Zürich, Ångström, façade, jalapeño.",
    "mixed": "Größe: 10€ — ok ✓ 🙂 fin.",
}


def ids_of(tok, s: str) -> list[int]:
    return tok.encode(s, add_special_tokens=False)


def stream(tok, out_ids: list[int], stop: list[str] = (), prompt: str = "Text:") -> tuple[list[str], int | None]:
    """Feed ``out_ids`` one at a time as the engine does; the deltas, and the index of the
    token that completed a stop string (None if none did)."""
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), list(stop))
    deltas = []
    for i, t in enumerate(out_ids):
        hit = detok.add(t)
        deltas.append(detok.delta(final=hit or i == len(out_ids) - 1))
        if hit:
            return deltas, i
    return deltas, None


@pytest.mark.parametrize("name", MULTI_BYTE)
def test_streamed_multi_byte_text_never_shows_a_broken_character(default_tokenizer, name):
    tok = default_tokenizer
    ids = ids_of(tok, MULTI_BYTE[name])
    # the case under test: some token boundaries fall inside a character
    assert any(tok.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))

    deltas, _ = stream(tok, ids)

    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == MULTI_BYTE[name]


def test_word_boundary_spaces_survive_streaming(default_tokenizer):
    tok = default_tokenizer
    s = " The quick brown fox jumps over the lazy dog, twice:  spaced  out."
    deltas, _ = stream(tok, ids_of(tok, s), prompt="Once more:")
    assert "".join(deltas) == s
    assert sum(1 for d in deltas if d) > 10  # streamed token by token, not held until the end


def test_stop_string_cuts_the_text_before_it(default_tokenizer):
    tok = default_tokenizer
    s = "The answer is 42.\nUser: and what else?"
    ids = ids_of(tok, s)
    deltas, stopped = stream(tok, ids, stop=["\nUser:"])

    assert "".join(deltas) == "The answer is 42."
    assert stopped is not None and stopped < len(ids) - 1  # stopped as soon as the stop string completed
    assert "User" in tok.decode(ids[: stopped + 1])


@pytest.mark.parametrize("s, stop", [
    ("A STAR is born. A STOP sign, then more.", ["STOP"]),  # a near miss first, then the stop string
    ("Counting: one two three four five six", [" four five"]),  # spans several tokens
    ("Prices 10€ and 20€ — 你好世界 and more", ["世界"]),  # multi-byte stop string
    ("alpha beta gamma delta", ["delta", "beta"]),  # the first to appear wins
    ("one foo bar baz", ["ar", " bar"]),  # completed by the same token: the earlier start wins
])
def test_no_partial_stop_string_is_ever_emitted(default_tokenizer, s, stop):
    tok = default_tokenizer
    expected = s[: min(s.index(x) for x in stop if x in s)]
    deltas, stopped = stream(tok, ids_of(tok, s), stop=stop)

    assert stopped is not None
    assert "".join(deltas) == expected
    shown = ""
    for d in deltas:  # at every point the client has seen a prefix of the final text
        shown += d
        assert expected.startswith(shown), f"emitted {shown!r}, final text is {expected!r}"
    assert all("\ufffd" not in d for d in deltas)


def test_held_back_text_is_flushed_when_no_stop_string_completes(default_tokenizer):
    tok = default_tokenizer
    s = "It ends with ST"
    detok = IncrementalDetokenizer(tok, tok.encode("Text:"), ["STOP"])
    shown = ""
    for t in ids_of(tok, s):
        assert not detok.add(t)
        shown += detok.delta(final=False)
    # "ST" may be the start of "STOP": not shown while the request runs ...
    assert s.startswith(shown) and not shown.endswith(("S", "ST"))
    # ... and released when it finishes without the stop string
    assert shown + detok.delta(final=True) == s


def test_chat_template_yields_chatml(default_tokenizer):
    tok = default_tokenizer
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    ids = tok.apply_chat_template(messages)

    assert tok.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # the markers are single special tokens, not spelled out in text pieces
    assert ids[0] == im_start
    assert ids.count(im_start) == 5 and ids.count(im_end) == 4
    assert tok.decode(ids) == "system\nBe brief.\nuser\nHi\nassistant\nHello!\nuser\nBye\nassistant\n"


def test_chat_template_adds_the_default_system_prompt(default_tokenizer):
    tok = default_tokenizer
    text_ = tok.decode(tok.apply_chat_template([{"role": "user", "content": "Hi there"}]), skip_special_tokens=False)
    assert text_.startswith("<|im_start|>system\n")
    assert text_.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("messages", [[], "hello", [{"role": "user"}], [{"role": "user", "content": 5}],
                                      ["just a string"]], ids=["empty", "string", "no-content", "int-content",
                                                               "not-an-object"])
def test_bad_messages_are_rejected(default_tokenizer, messages):
    with pytest.raises(InvalidRequestError, match="message") as err:
        default_tokenizer.apply_chat_template(messages)
    assert err.value.param == "messages"


def test_stop_strings_need_a_tokenizer(tiny_engine):
    engine = tiny_engine()
    with pytest.raises(InvalidRequestError, match="tokenizer") as err:
        engine.add_request("r", [5, 6, 7], SamplingParams(stop=["x"]))
    assert err.value.param == "stop"
    assert_no_leaks(engine)


# ---- through the engine ------------------------------------------------------------------------


@pytest.mark.slow
def test_engine_stream_is_the_decoded_tokens(default_model):
    engine = default_model
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Translate to French: I like coffee, cake and the summer."}])
    outs = generate(engine, {"r": prompt}, SamplingParams(max_tokens=24, temperature=0))["r"]
    assert all("\ufffd" not in o.new_text for o in outs)
    assert text(outs) == engine.tokenizer.decode(tokens(outs))
    assert_no_leaks(engine)


@pytest.mark.slow
def test_engine_stop_string(default_model):
    engine = default_model
    prompt = engine.tokenizer.encode("1, 2, 3, 4, 5,")
    free = text(generate(engine, {"r": prompt}, SamplingParams(max_tokens=12, temperature=0))["r"])
    stop = free[free.index("8") - 2: free.index("8") + 1]  # ", 8" or similar, inside the free-run text
    assert stop in free

    outs = generate(engine, {"r": prompt}, SamplingParams(max_tokens=12, temperature=0, stop=[stop]))["r"]

    assert outs[-1].finish_reason == "stop"
    assert text(outs) == free[: free.index(stop)]
    shown = ""
    for o in outs:
        shown += o.new_text
        assert free[: free.index(stop)].startswith(shown)
    assert len(tokens(outs)) < 12
    assert_no_leaks(engine)
