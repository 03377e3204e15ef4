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
    """Name, tokenizer and context length from the model's card: no weights, and no torch even on a cold
    cache (a GGUF's tokenizer is read from its metadata; services/engine/model_source.py)."""
    from services.engine.model_source import model_card
    from services.engine.tokenizer import Tokenizer

    card = model_card(model)
    tokenizer = Tokenizer(card.tokenizer_dir) if card.tokenizer_dir else None
    return ServedModel(card.name, tokenizer, card.max_position_embeddings, card.vocab_size)
