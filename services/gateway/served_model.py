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


def check_cascade(spec, models: dict[str, ServedModel]) -> None:
    """A cascade's tiers (services/cascade.py) must be served here and read one tokenizer's ids: the prompt is
    tokenized once, with the first tier's tokenizer, and runs on every tier. ValueError says why not."""
    missing = [t for t in spec.tiers if t not in models]
    if missing:
        raise ValueError(f"the cascade's tiers {missing} are not served here (served: {list(models)}); give each "
                         "with --model")
    first = models[spec.tiers[0]]
    if first.tokenizer is None:
        raise ValueError(f"the cascade's first tier {first.name!r} has no tokenizer; it tokenizes every tier's prompt")
    other = [t for t in spec.tiers[1:] if models[t].vocab_size != first.vocab_size]
    if other:
        raise ValueError(f"the cascade's tiers {other} have another vocabulary than {first.name!r} "
                         f"({[models[t].vocab_size for t in other]} vs {first.vocab_size} tokens): one prompt "
                         "cannot run on both")
