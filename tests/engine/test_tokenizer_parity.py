"""The torch-free tokenizer (tokenizers + jinja2) against transformers' AutoTokenizer on the same model.

The gateway and the router tokenize with ``services.engine.tokenizer.Tokenizer`` so they never
import transformers (whose tokenizer classes import torch); the workers used to tokenize with
AutoTokenizer. A prompt must become the same token ids either way, and a GGUF's tokenizer read
from its metadata on a cold cache must be the one transformers builds from the same file.
"""

from __future__ import annotations

import json
import random

import pytest

from services.engine.model_source import default_model_path, model_card
from services.engine.tokenizer import Tokenizer
from services.errors import InvalidRequestError, ModelLoadError

TEXTS = [
    "Hello world",
    " leading space and trailing  ",
    "Waving 👋🏽 at the family 👩‍👩‍👧 — 你好，世界！ Zürich, jalapeño.",
    "def f(x):\n\treturn x ** 2  # squares\n\n\n",
    "<|im_start|>user\nspecial tokens typed as text<|im_end|>",
    "numbers 1234567890 3.14159 -42 1e-9",
    "",
    "   ",
    "I can't, you're, we've, they'll, he'd",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye 👋"}],
    [{"role": "user", "content": "  spaces\n\nand lines  "}],
]
# a template using what transformers' environment adds: tojson without HTML escaping, loop
# controls, raise_exception, {% generation %}, and the special tokens as variables
FEATURES_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}\n"  # trim_blocks: no newline after a block tag
    "    {% if m.role == 'skip' %}{% continue %}{% endif %}\n"  # lstrip_blocks: no indent before one
    "    {% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}\n"
    "{% generation %}{{ m.role }}:{{ m.content | tojson }}{% endgeneration %}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoTokenizer

    gguf = default_model_path()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="module")
def cold_tokenizer(tmp_path_factory):
    """The default model's tokenizer read from the GGUF into an empty cache, as a fresh gateway does."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PDSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cold-cache")))
    try:
        card = model_card(None)
        assert str(card.tokenizer_dir).startswith(str(tmp_path_factory.getbasetemp()))
        yield Tokenizer(card.tokenizer_dir)
    finally:
        mp.undo()


@pytest.mark.parametrize("text", TEXTS)
def test_encoding_matches_transformers(cold_tokenizer, reference, text):
    for add_special in (True, False):
        assert cold_tokenizer.encode(text, add_special) == reference.encode(text, add_special_tokens=add_special)


def test_decoding_matches_transformers(cold_tokenizer, reference):
    rng = random.Random(0)
    vocab = reference.vocab_size
    samples = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(200)]
    samples += [[0, 1, 2, 3, 4], [1, 9690, 198, 2], reference.encode(TEXTS[2])]
    for ids in samples:
        for skip in (True, False):
            assert cold_tokenizer.decode(ids, skip) == reference.decode(ids, skip_special_tokens=skip), ids


def test_special_tokens_match_transformers(cold_tokenizer, reference):
    assert cold_tokenizer.eos_token_id == reference.eos_token_id
    assert cold_tokenizer.special_tokens == {k: v for k, v in reference.special_tokens_map.items()
                                             if isinstance(v, str)}


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one-turn", "multi-turn", "whitespace"])
def test_chat_template_matches_transformers(cold_tokenizer, reference, messages):
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert cold_tokenizer.apply_chat_template(messages) == reference.encode(expected, add_special_tokens=False)


def test_template_environment_matches_transformers(tmp_path, cold_tokenizer, reference):
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "tokenizer.json").write_text(cold_tokenizer.backend.to_str())
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": FEATURES_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(directory)
    messages = [{"role": "user", "content": 'quote " <b>html</b> & ünï'}, {"role": "skip", "content": "x"},
                {"role": "assistant", "content": "ok"}]
    expected = reference.apply_chat_template(messages, chat_template=FEATURES_TEMPLATE, tokenize=False,
                                             add_generation_prompt=True)
    assert '"quote \\" <b>html</b> & ünï"' in expected  # tojson kept the HTML and the non-ASCII as is
    assert tok.apply_chat_template(messages) == reference.encode(expected, add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="no bad roles") as err:
        tok.apply_chat_template([{"role": "bad", "content": "x"}])
    assert err.value.param == "messages"


def test_a_broken_template_fails_at_load(tmp_path, cold_tokenizer):
    (tmp_path / "tokenizer.json").write_text(cold_tokenizer.backend.to_str())
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ModelLoadError, match="chat template is not valid Jinja"):
        Tokenizer(tmp_path)


def test_a_directory_with_only_a_slow_tokenizer_says_how_to_write_tokenizer_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 32, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64}))
    (tmp_path / "tokenizer.model").write_bytes(b"sentencepiece")
    with pytest.raises(ModelLoadError, match="no tokenizer.json.*save_pretrained"):
        model_card(str(tmp_path))
