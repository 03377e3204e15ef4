"""The model's tokenizer, its chat template, and incremental detokenization. No torch, no transformers.

``Tokenizer`` reads ``tokenizer.json`` with the ``tokenizers`` library and the special tokens
and chat template from ``tokenizer_config.json`` (``chat_template.py`` renders it as
transformers does), so the gateway and the router tokenize without importing transformers,
whose tokenizer classes import torch. Encoding and decoding match transformers' fast
tokenizer on the same files (tests/engine/test_tokenizer.py checks it on the default model).

``IncrementalDetokenizer`` turns a growing list of token ids into text deltas
that never end in a broken UTF-8 sequence: a byte-level token that is half of a
multi-byte character decodes to U+FFFD, so the delta is held back until the
character completes. Stop strings are matched on the text, and up to
``len(longest stop) - 1`` characters are held back while streaming so a stop
string never shows up half-emitted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.engine import chat_template
from services.errors import InvalidRequestError, ModelLoadError

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers' clean_up_tokenization, for the (WordPiece-era) tokenizers that ask for it
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, directory: Path):
        directory = Path(directory)
        try:
            from tokenizers import Tokenizer as Backend

            self.backend = Backend.from_file(str(directory / "tokenizer.json"))
            config_file = directory / "tokenizer_config.json"
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
            self.chat_template = chat_template.find_chat_template(directory, config)
            if self.chat_template:
                chat_template.compile_template(self.chat_template)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"cannot load tokenizer from {directory}: {exc}") from exc
        self.special_tokens = {name: text for name in _SPECIAL_NAMES
                               if (text := _token_text(config.get(name))) is not None}
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id = self.backend.token_to_id(eos) if eos is not None else None
        # transformers skips the clean-up for BPE vocabularies, where it would eat real spaces
        self._clean_up = bool(config.get("clean_up_tokenization_spaces")) and type(self.backend.model).__name__ != "BPE"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for old, new in _CLEANUPS:
                text = text.replace(old, new)
        return text

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` list (else the gateway writes it into a
        system message: services/gateway/tools.py)."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidRequestError(
                    "each message must be an object with string 'role' and 'content'", param="messages"
                )
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; send a raw prompt instead")
        text = chat_template.render(self.chat_template, messages, self.special_tokens, tools=tools)
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    # decode a few tokens before the new ones, so word-boundary spaces come out right
    _CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-self._CONTEXT :])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.skip_special = skip_special_tokens
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all output text so far (truncated at a stop string)
        self.emitted = 0  # characters of self.text already returned

    def add(self, token_id: int) -> bool:
        """Append one token. Returns True if a stop string was found (text is cut before it)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special)
        full = decode(self.ids[self.prefix_offset :], self.skip_special)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # incomplete character (or nothing visible): wait for more tokens
        new = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        search_from = max(0, len(self.text) - self.hold)
        self.text += new
        hits = [at for s in self.stop if (at := self.text.find(s, search_from)) != -1]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def delta(self, final: bool) -> str:
        """New text since the last call; holds back a possible stop-string prefix unless final."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
