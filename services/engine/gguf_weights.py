"""``--quantization gguf``: the projections of a GGUF model served from the file's own blocks.

Every projection (q/k/v fused, o, gate/up fused, down) and the output projection becomes a
``GGUFLinear`` (kernels/gguf_linear.py) over the tensor's Q4_0 / Q4_1 / Q8_0 blocks as
they are in the file: nothing is widened to bf16 at load. The embedding table used for
lookups, the norms and the rest of the model stay as the loader built them from the
converted checkpoint (a lookup reads one row per token, not the whole table).

llama.cpp's converter stores the q and k rows of "llama" models permuted for its rotary
layout; transformers undoes that when it reads the file (``_reverse_permute_weights``), so
the same row permutation is applied here to whole rows of blocks.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.gguf_linear import KINDS, GGUFLinear
from services.errors import ModelLoadError

# our projection -> the GGUF tensors whose rows it stacks
_LAYER = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


def _unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row i of the model's tensor is row ``perm[i]`` of the file's (transformers' reverse permute)."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).view(n_head, dim, 2).transpose(1, 2).reshape(n_rows)


def _architecture(reader) -> str:
    field = reader.fields.get("general.architecture")
    return bytes(field.parts[field.data[0]]).decode() if field is not None else ""


def use_gguf_blocks(model, source, ops) -> None:
    import gguf

    path = source.gguf_file
    if path is None:
        raise ModelLoadError(f"--quantization gguf serves a GGUF file's blocks; {source.name} is not a .gguf model "
                             "(use --quantization int8 for a Hugging Face directory)")
    if not ops.packs_linears:
        raise ModelLoadError("--quantization gguf runs on the CPU kernels; use --kernels auto")
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    cfg = model.config
    permute = _architecture(reader) == "llama"

    def rows(name: str) -> tuple[torch.Tensor, str]:
        t = tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{path.name} has no tensor {name}")
        kind = t.tensor_type.name
        if kind not in KINDS:
            raise ModelLoadError(f"--quantization gguf serves Q4_0, Q4_1 and Q8_0 tensors; {path.name} stores {name} "
                                 f"as {kind} (serve it with --quantization none: dequantized to --dtype)")
        raw = torch.from_numpy(np.array(t.data, copy=True))
        if permute and (".attn_q." in name or ".attn_k." in name):
            raw = raw[_unpermute_rows(raw.shape[0], cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads)]
        return raw, kind

    def linear(names: list[str], bias: torch.Tensor | None) -> GGUFLinear:
        parts = [rows(n) for n in names]
        kinds = {k for _, k in parts}
        if len(kinds) > 1:
            raise ModelLoadError(f"{', '.join(names)} mix block types {sorted(kinds)}; --quantization gguf needs one "
                                 "type per fused projection")
        raw = torch.cat([r for r, _ in parts])
        layer = GGUFLinear(raw, kinds.pop(), int(tensors[names[0]].shape[0]), bias)
        return layer

    for i, layer in enumerate(model.layers):
        for attr, names in _LAYER.items():
            owner_name, leaf = attr.split(".")
            owner = getattr(layer, owner_name)
            old = getattr(owner, leaf)
            setattr(owner, leaf, linear([f"blk.{i}.{n}.weight" for n in names], old.bias))
    output = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    if model.lm_head is not None and output == "token_embd.weight":
        raise ModelLoadError(f"{path.name} has no output.weight for this untied model")
    model.logits_proj = linear([output], None)
    if model.lm_head is not None:
        model.lm_head = model.logits_proj
