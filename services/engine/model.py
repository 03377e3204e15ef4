"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

Projections are fused (qkv, gate_up) so a layer is four matmuls. Every fused
op goes through ``self.ops`` (torch references on CPU, Triton on CUDA), and
attention reads and writes the paged cache directly, so one forward can mix
prefill chunks of some sequences with single-token decodes of others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.decode_layers_cpu import DecodeLayers
from kernels.gguf_linear import GGUFLinear
from kernels.linear_cpu import PackedLinear
from kernels.ops import Ops
from services.engine.attention_metadata import AttentionMetadata
from services.engine.kv_cache import layer_view
from services.engine.model_config import ModelConfig
from services.engine.rope import build_cos_sin_cache


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, ops: Ops,
                cos_sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        lora = meta.lora
        qkv = self.qkv_proj(x)
        if lora is not None:
            lora.apply(self.layer_idx, "qkv", qkv, x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = ops.rotary(q, k, positions, cos_sin)
        k_cache, v_cache = layer_view(meta.kv_cache, self.layer_idx)
        ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decode_tokens
        if not meta.has_prefill:
            out = ops.decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                       meta.decode_context_lens, self.scale)
        elif nd == 0:
            out = ops.prefill_attention(q, k_cache, v_cache, meta.prefill_block_tables,
                                        meta.prefill_cu_seqlens_q, meta.prefill_context_lens, self.scale)
        else:
            out = torch.empty_like(q)
            out[:nd] = ops.decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                            meta.decode_context_lens, self.scale)
            out[nd:] = ops.prefill_attention(q[nd:], k_cache, v_cache, meta.prefill_block_tables,
                                             meta.prefill_cu_seqlens_q, meta.prefill_context_lens, self.scale)
        out = out.reshape(num_tokens, self.q_size)
        y = self.o_proj(out)
        if lora is not None:
            lora.apply(self.layer_idx, "o", y, out)
        return y


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: Ops, lora=None, layer_idx: int = 0) -> torch.Tensor:
        if lora is None:
            return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        gate_up = self.gate_up_proj(x)
        lora.apply(layer_idx, "gate_up", gate_up, x)
        act = ops.silu_and_mul(gate_up)
        y = self.down_proj(act)
        lora.apply(layer_idx, "down", y, act)
        return y


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, meta, ops, cos_sin):
        norm = self.input_layernorm
        if residual is None:
            residual = x
            h = ops.rms_norm(x, norm.weight, norm.eps)
        else:
            h, residual = ops.rms_norm(x, norm.weight, norm.eps, residual)
        h = self.self_attn(h, positions, meta, ops, cos_sin)
        norm = self.post_attention_layernorm
        h, residual = ops.rms_norm(h, norm.weight, norm.eps, residual)
        return self.mlp(h, ops, meta.lora, self.self_attn.layer_idx), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, max_positions: int):
        super().__init__()
        self.config = cfg
        self.ops = ops
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.logits_proj: PackedLinear | GGUFLinear | None = None  # set by pack_linears / gguf_weights
        # tied embeddings whose output projection differs from the lookup table (the int8
        # reference path: the dequantized table multiplies, the original one is looked up)
        self.output_weight: torch.Tensor | None = None
        self.register_buffer(
            "cos_sin_cache",
            build_cos_sin_cache(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling),
            persistent=False,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]``."""
        x = self.embed_tokens(input_ids)
        if x.device.type == "cpu":
            fused = self._decode_layers(meta.kv_cache)
            if fused is not None and (out := fused(x, positions, meta)) is not None:
                return out
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, meta, self.ops, self.cos_sin_cache)
        x, _ = self.ops.rms_norm(x, self.norm.weight, self.norm.eps, residual)
        return x

    def _decode_layers(self, kv_cache: torch.Tensor) -> DecodeLayers | None:
        """The C driver of CPU steps over this cache (kernels/decode_layers_cpu.py), built once."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape))
        if getattr(self, "_fused_key", None) != key:
            self._fused_key, self._fused = key, DecodeLayers.build(self, kv_cache)
        return self._fused

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.logits_proj is not None:
            return self.logits_proj(hidden, out_dtype=torch.float32)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.output_weight is not None:
            weight = self.output_weight
        return F.linear(hidden, weight).float()

    def pack_linears(self, int8: dict | None = None) -> None:
        """CPU: every projection becomes a ``PackedLinear`` (kernels/linear_cpu.c), and the output
        projection is packed too, giving fp32 logits. bf16 weights (fp32 FMAs, or AMX tiles for
        many rows), or with ``int8`` (name -> (int8 weight, scale), services/engine/quantize.py)
        weight-only int8. The embedding table stays as it is for lookups, so with tied
        embeddings the model holds it twice."""
        from services.engine.quantize import OUTPUT

        def packed(name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear:
            if int8 is None:
                return PackedLinear(weight, bias)
            q, scale = int8[name]
            return PackedLinear(q, bias, scale)

        for prefix, module in list(self.named_modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    full = f"{prefix}.{name}" if prefix else name
                    setattr(module, name, packed(full, child.weight, child.bias))
        if self.lm_head is None:
            self.logits_proj = packed(OUTPUT, self.embed_tokens.weight, None)
        else:
            self.logits_proj = self.lm_head  # already packed above

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Our weights by our (fused) parameter names, packed projections unpacked."""
        tensors = {name: p.data for name, p in self.named_parameters()}
        for name, module in self.named_modules():
            if isinstance(module, (PackedLinear, GGUFLinear)) and name != "logits_proj":  # logits_proj: the embedding
                dtype = self.embed_tokens.weight.dtype  # int8 weights: dequantized to the model's dtype
                tensors[f"{name}.weight"] = module.unpacked_weight(dtype)
                if module.bias is not None:
                    tensors[f"{name}.bias"] = module.bias.to(dtype)
        return tensors

    # HF checkpoint name -> (our parameter name, (start, end) rows of the fused tensor or None)
    _FUSED = (
        ("self_attn.q_proj", "self_attn.qkv_proj", 0),
        ("self_attn.k_proj", "self_attn.qkv_proj", 1),
        ("self_attn.v_proj", "self_attn.qkv_proj", 2),
        ("mlp.gate_proj", "mlp.gate_up_proj", 0),
        ("mlp.up_proj", "mlp.gate_up_proj", 1),
    )

    def _hf_target(self, hf_name: str):
        name = hf_name.removeprefix("model.")
        for src, dst, index in self._FUSED:
            if src in name:
                return name.replace(src, dst), self._fused_rows(dst)[index]
        return name, None

    def load_weights(self, weights) -> None:
        """``weights``: iterable of (HF name, tensor). Every parameter must be covered."""
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue
            name, rows = self._hf_target(hf_name)
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the output projection
            if name not in params:
                raise ValueError(f"checkpoint has unexpected tensor {hf_name!r}")
            param = params[name]
            target = param.data if rows is None else param.data[rows[0]:rows[1]]
            if target.shape != tensor.shape:
                raise ValueError(f"shape mismatch for {hf_name}: checkpoint {tuple(tensor.shape)}, model {tuple(target.shape)}")
            target.copy_(tensor)
            seen.add(f"{name}:{rows}")
        expected = set()
        for name, _ in self.named_parameters():
            if "qkv_proj" in name or "gate_up_proj" in name:
                expected |= {f"{name}:{r}" for r in self._fused_rows(name)}
            else:
                expected.add(f"{name}:None")
        missing = expected - seen
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def _fused_rows(self, name: str):
        cfg = self.config
        if "qkv_proj" in name:
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
        inter = cfg.intermediate_size
        return [(0, inter), (inter, 2 * inter)]
