"""The model the gateway serves: its name, tokenizer (chat template) and context length; no weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ServedModel:
    name: str  # what /v1/models lists and requests must name
    tokenizer: Any  # services.engine.tokenizer.Tokenizer, or None (token-id prompts only)
    max_model_len: int  # from the model's config (or --max-model-len); decode workers may say less
    vocab_size: int = 0  # 0: unknown (token ids are not range-checked)


def load_served_model(model: str | None) -> ServedModel:
    """Tokenizer and name through the router's ``load_tokenizer``; the context length from the model config."""
    from services.engine.loader import resolve_model
    from services.router.server import load_tokenizer

    tokenizer, name = load_tokenizer(model)
    config = resolve_model(model).config  # resolved twice: the second finds the cached conversion
    return ServedModel(name, tokenizer, config.max_position_embeddings, getattr(config, "vocab_size", 0))
