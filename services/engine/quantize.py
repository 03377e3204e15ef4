"""Weight-only int8 (``--quantization int8``): per-output-channel symmetric scales, computed once
from the checkpoint's own tensors and cached beside the converted model.

Which weights: every projection (fused qkv and gate/up, o, down) and the output projection
(with tied embeddings, a quantized copy of the embedding: the lookup table itself stays in the
model's dtype). Quantizing from the checkpoint (fp32 for the default model) rather than from
the bf16 weights the model holds avoids rounding twice.

Cache: ``$PDSERVE_CACHE_DIR/int8/<model directory>-<key>.safetensors``, beside the converted
GGUF models, keyed by the checkpoint directory and its files' names, sizes and times. Never in
the model's own directory (the loader reads every ``*.safetensors`` there as weights, and a
user's model directory is not ours to write).
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

import torch

from kernels.linear_cpu import quantize_int8

OUTPUT = "logits_proj"  # the output projection's name in the cache


def projection_names(model) -> list[str]:
    """Parameter names (without ``.weight``) of the projections that get quantized."""
    from torch import nn

    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    return names + ([OUTPUT] if model.lm_head is None else [])


def _cache_file(weights_dir: Path, cache_root: Path) -> Path:
    # never inside the model directory: the loader reads every *.safetensors there as weights
    weights_dir = weights_dir.resolve()
    h = hashlib.blake2b(str(weights_dir).encode(), digest_size=10)
    for f in sorted(weights_dir.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return cache_root / "int8" / f"{weights_dir.name}-{h.hexdigest()}.safetensors"


def _from_checkpoint(model, checkpoint) -> dict[str, torch.Tensor]:
    """Quantize the projections from ``checkpoint`` ((HF name, tensor) pairs, as the loader
    reads them): fused tensors are assembled in fp32 first, then quantized per output row."""
    wanted = set(projection_names(model))
    full: dict[str, torch.Tensor] = {}
    for hf_name, tensor in checkpoint:
        name, rows = model._hf_target(hf_name)
        if name == "embed_tokens.weight" and OUTPUT in wanted:
            name = f"{OUTPUT}.weight"
        if not name.endswith(".weight") or name.removesuffix(".weight") not in wanted:
            continue
        if rows is None:
            full[name] = tensor.float()
        else:
            shape = (model._fused_rows(name)[-1][1], tensor.shape[1])
            target = full.setdefault(name, torch.zeros(shape))
            target[rows[0] : rows[1]] = tensor.float()
    out = {}
    for name in sorted(wanted):
        if f"{name}.weight" not in full:
            raise ValueError(f"the checkpoint has no weight for {name}")
        q, scale = quantize_int8(full[f"{name}.weight"])
        out[f"{name}.q"], out[f"{name}.scale"] = q, scale
    return out


def int8_weights(model, weights_dir: Path | None, checkpoint, cache_root: Path) -> dict[str, tuple]:
    """name -> (int8 weight, fp32 scale) for every projection of ``model``: from the cache, or
    quantized from ``checkpoint`` (a callable giving (HF name, tensor) pairs) and cached.
    Without a checkpoint (dummy weights) they are quantized from the model's own weights."""
    from safetensors.torch import load_file, save_file

    if weights_dir is None:
        params = dict(model.named_parameters())
        tensors = {}
        for name in projection_names(model):
            source = params["embed_tokens.weight" if name == OUTPUT else f"{name}.weight"]
            tensors[f"{name}.q"], tensors[f"{name}.scale"] = quantize_int8(source)
    else:
        path = _cache_file(weights_dir, cache_root)
        if path.is_file():
            tensors = load_file(str(path))
        else:
            print(f"[pdserve] quantizing {weights_dir.name} to int8 (once; cached in {path})", file=sys.stderr)
            tensors = _from_checkpoint(model, checkpoint())
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".safetensors")
            os.close(fd)
            try:
                save_file(tensors, tmp)
                os.replace(tmp, path)  # atomic: a half-written cache is never read
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    return {name: (tensors[f"{name}.q"], tensors[f"{name}.scale"]) for name in projection_names(model)}
