"""The model's HF tokenizer, its chat template, and incremental detokenization.

``IncrementalDetokenizer`` turns a growing list of token ids into text deltas
that never end in a broken UTF-8 sequence: a byte-level token that is half of a
multi-byte character decodes to U+FFFD, so the delta is held back until the
character completes. Stop strings are matched on the text, and up to
``len(longest stop) - 1`` characters are held back while streaming so a stop
string never shows up half-emitted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.errors import InvalidRequestError, ModelLoadError


class Tokenizer:
    def __init__(self, directory: Path):
        try:
            from transformers import AutoTokenizer

            self.hf = AutoTokenizer.from_pretrained(str(directory))
        except Exception as exc:
            raise ModelLoadError(f"cannot load tokenizer from {directory}: {exc}") from exc
        self.eos_token_id = self.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=True)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidRequestError(
                    "each message must be an object with string 'role' and 'content'", param="messages"
                )
        if not self.hf.chat_template:
            raise InvalidRequestError("this model has no chat template; send a raw prompt instead")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.hf.encode(text, add_special_tokens=False)


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
