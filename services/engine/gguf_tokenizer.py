"""A GGUF file's tokenizer and context length, written once as Hugging Face tokenizer files. No torch.

The gateway and the router need the tokenizer and the chat template but never the weights,
and a front process may start where no worker ever converted the model (another container,
a fresh cache). So the tokenizer comes straight from the GGUF metadata: the vocabulary,
merges and special tokens are rebuilt by transformers' own GGUF tokenizer builders (the code
``AutoTokenizer.from_pretrained(..., gguf_file=...)`` runs, which import no torch), and saved
as ``tokenizer.json`` + ``tokenizer_config.json`` (+ the chat template) beside a ``card.json``
with the context length and vocabulary size. Workers read the same files, so every process
of a deployment tokenizes alike.

transformers' own metadata reader imports torch, hence ``gguf_metadata.py``; the few lines
that group its keys follow ``transformers.integrations.gguf.get_gguf_tokenizer``.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from services.engine.gguf_metadata import read_metadata
from services.errors import ModelLoadError

CARD_FILE = "card.json"
# tokenizer_config names -> the metadata key of the token id (tokenizer.ggml.<key>)
_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                   "pad_token": "padding_token_id"}


def _tokenizer_kwargs(metadata: dict, mapping: dict) -> tuple[dict, dict]:
    """(tokenizer_dict for transformers' builders, tokenizer_config) as get_gguf_tokenizer groups them."""
    grouped = {group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                       if f"tokenizer.{key}" in metadata}
               for group, renames in mapping.items()}
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp adds BOS to a sentencepiece vocab unless told
    elif tokenizer.get("tokenizer_type") == "gemma4":
        config["add_bos_token"] = False  # its chat template writes <bos> itself
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    return tokenizer, config


def _write_tokenizer(gguf: Path, metadata: dict, directory: Path) -> None:
    try:
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError as exc:
        raise ModelLoadError(f"reading the tokenizer of {gguf.name} needs transformers>=5.24 "
                             f"(transformers.integrations.gguf): {exc}") from exc
    if "tokenizer.ggml.tokens" not in metadata:
        raise ModelLoadError(f"{gguf} has no tokenizer in its metadata")
    tokenizer, config = _tokenizer_kwargs(metadata, GGUF_TOKENIZER_MAPPING)
    try:
        backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer)
        TokenizersBackend(tokenizer_object=backend, **config, **extra).save_pretrained(directory)
    except Exception as exc:  # transformers raises many types for a vocabulary it cannot build
        raise ModelLoadError(f"cannot build the tokenizer of {gguf}: {exc}") from exc


def gguf_card(gguf: Path, target: Path) -> tuple[Path, int, int]:
    """(tokenizer directory, context length, vocabulary size) of ``gguf``, from ``target`` once written."""
    card_file = target / CARD_FILE
    if not card_file.is_file():
        print(f"[pdserve] reading the tokenizer of {gguf.name} (once; cached in {target})", file=sys.stderr)
        metadata = read_metadata(gguf)
        arch = metadata["general.architecture"]
        vocab = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens", ()))
        card = {"architecture": arch, "max_position_embeddings": int(metadata.get(f"{arch}.context_length", 4096)),
                "vocab_size": int(vocab), "source": gguf.name}
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tokenizer-"))
        try:
            _write_tokenizer(gguf, metadata, tmp)
            (tmp / CARD_FILE).write_text(json.dumps(card, indent=1) + "\n")
            tmp.rename(target)  # atomic: a half-written directory is never picked up
        except OSError:
            if not card_file.is_file():  # another process won the race, or the cache is not writable
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    try:
        card = json.loads(card_file.read_text())
        return target, int(card["max_position_embeddings"]), int(card["vocab_size"])
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"bad {card_file}: {exc}; delete {target} to rebuild it") from exc
