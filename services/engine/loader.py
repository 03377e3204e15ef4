"""Load a model's weights onto the device: safetensors (or random weights for ``dummy:``) -> the model.

Which files a ``--model`` names, the GGUF conversion and the tokenizer are in
``model_source.py``, which imports no torch; this module is what only workers run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels.linear_cpu import kernel_available as linear_kernel_available
from kernels.ops import Ops
from services.engine.model import LlamaForCausalLM
from services.engine.model_source import ModelSource, cache_dir
from services.engine.rope import build_cos_sin_cache
from services.errors import ModelLoadError


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
