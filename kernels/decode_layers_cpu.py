"""A CPU step's decoder layers in one call into the C kernels (decode_layers_cpu.c).

At batch 1 on a small CPU, the model's Python code around its ~12 kernel calls per layer
(module calls, argument checks, ctypes conversions, output tensors) cost about a fifth of a
decode step, serially. A step with a prefill chunk paid it too: the step that computes a
cached prompt's last few tokens (a repeated prompt's first token on the decode worker that
holds its blocks) took twice a decode step's CPU (18.6 against 9.0 ms, gguf weights, 1
thread; benchmarks/probes/cached_tail_step.py), and a 16-stream batch that took a newcomer
ran its whole step on the Python path. Decode rows, prefill chunks and steps mixing both now
take the driver; the prefill chunks' attention is the same C kernel the Python path calls. ``DecodeLayers.build`` checks once per model and KV cache that every
layer is one the C driver can run (the CPU kernels at AVX-512 or above, bf16 activations,
PackedLinear or bias-free GGUFLinear projections, a cache layout the kernels take); the
driver then makes the same kernel calls with the same arguments in the same order, so a
step's output is bitwise what the Python path computes (tests/kernels/test_decode_layers.py).
Models or caches it does not take stay on the Python path, and so do prefill chunks where the C
prefill attention does not apply (no AVX-512, a head size or group it does not take).
``PDSERVE_FUSED_DECODE=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import os
from ctypes import c_float, c_int32, c_int64, c_void_p

import torch

from kernels import native
from kernels.fused_cpu import _fused_available
from kernels.gguf_linear import KINDS as GGUF_KINDS
from kernels.gguf_linear import GGUFLinear
from kernels.linear_cpu import _KINDS as PACKED_KINDS
from kernels.linear_cpu import PackedLinear
from kernels.paged_attention_cpu import PREFILL_MAX_GROUP

ENV = "PDSERVE_FUSED_DECODE"


class _Linear(ctypes.Structure):
    _fields_ = [("gguf", c_int32), ("kind", c_int32), ("weight", c_void_p), ("scale", c_void_p),
                ("bias", c_void_p), ("n", c_int32), ("k", c_int32)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", c_void_p), ("post_norm", c_void_p), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("k_cache", c_void_p), ("v_cache", c_void_p),
                ("lora_a", c_void_p * 4), ("lora_bt", c_void_p * 4), ("lora_as", c_void_p * 4),
                ("lora_bs", c_void_p * 4)]


class _Rows(ctypes.Structure):  # pd_rows: a step's decode rows, then its prefill chunks
    _fields_ = [("nd", c_int32), ("block_tables", c_void_p), ("bt_stride", c_int64), ("context_lens", c_void_p),
                ("pf_seqs", c_int32), ("pf_block_tables", c_void_p), ("pf_bt_stride", c_int64),
                ("pf_cu_seqlens_q", c_void_p), ("pf_context_lens", c_void_p)]


class _Model(ctypes.Structure):
    _fields_ = [("layers", c_int32), ("heads", c_int32), ("kv_heads", c_int32), ("head_dim", c_int32),
                ("hidden", c_int32), ("inter", c_int32), ("block_size", c_int32), ("kv_int8", c_int32),
                ("eps", c_float), ("scale", c_float), ("c_sb", c_int64), ("c_st", c_int64), ("c_sh", c_int64),
                ("cos_sin", c_void_p), ("ldc", c_int64), ("lora_idx", c_void_p), ("lora_ranks", c_void_p),
                ("lora_rank", c_int32), ("lora_fmt", c_int32)]


def _linear(mod) -> _Linear | None:
    if isinstance(mod, PackedLinear) and mod.packed.dtype in PACKED_KINDS:
        if mod.bias is not None and (mod.bias.dtype != torch.float32 or not mod.bias.is_contiguous()):
            return None
        return _Linear(0, PACKED_KINDS[mod.packed.dtype], mod.packed.data_ptr(),
                       None if mod.scale is None else mod.scale.data_ptr(),
                       None if mod.bias is None else mod.bias.data_ptr(), mod.out_features, mod.in_features)
    if isinstance(mod, GGUFLinear) and mod.bias is None:
        return _Linear(1, GGUF_KINDS[mod.kind], mod.packed.data_ptr(), None, None, mod.out_features, mod.in_features)
    return None


def _bf16_vector(t: torch.Tensor, size: int) -> bool:
    return t.dtype == torch.bfloat16 and t.is_contiguous() and t.numel() == size and t.device.type == "cpu"


class DecodeLayers:
    def __init__(self, lib, model: _Model, layers, final_norm: torch.Tensor, q_size: int, kv_size: int,
                 prefill: bool):
        self.lib, self.model, self.layers, self.final_norm = lib, model, layers, final_norm
        self.q_size, self.kv_size = q_size, kv_size
        self.prefill = prefill  # steps with prefill chunks too (the C prefill attention applies)
        self._lora_stacks = None  # the LoRASlots whose stacks the layers point at

    @classmethod
    def build(cls, model, kv_cache: torch.Tensor) -> DecodeLayers | None:
        """The driver for ``model`` (a LlamaForCausalLM) over ``kv_cache``, or None where it does not apply."""
        from services.engine.kv_cache import layer_view

        lib = native.library()
        lim = native.limits()
        if (os.environ.get(ENV, "1") == "0" or lib is None or lim is None or not hasattr(lib, "pdserve_decode_layers")
                or not _fused_available(lib) or not lib.pdserve_linear_available()
                or getattr(model.ops, "name", "") != "cpu" or kv_cache.device.type != "cpu"
                or model.embed_tokens.weight.dtype != torch.bfloat16):
            return None
        cfg = model.config
        attn0 = model.layers[0].self_attn
        heads, kv_heads, head_dim = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
        k0, v0 = layer_view(kv_cache, 0)
        kv_int8 = k0.dtype == torch.int8
        if kv_int8:
            fits = k0.shape[3] == head_dim + 4 and head_dim % 32 == 0 and k0.stride(2) == k0.shape[3]
        else:
            fits = k0.dtype == torch.bfloat16 and k0.stride(2) == head_dim
        cos_sin = model.cos_sin_cache
        if (not fits or k0.stride(3) != 1 or k0.stride() != v0.stride() or heads % kv_heads
                or heads // kv_heads > lim.max_group or head_dim > lim.max_head_dim or head_dim % 2 or head_dim > 512
                or k0.shape[1] > lim.max_block_size or cos_sin.dtype != torch.float32 or cos_sin.stride(1) != 1):
            return None
        layers = (_Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            projections = [_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(p is None for p in projections) or not all(_bf16_vector(w, cfg.hidden_size) for w in norms):
                return None
            k, v = layer_view(kv_cache, i)
            layers[i] = _Layer(norms[0].data_ptr(), norms[1].data_ptr(), *projections, k.data_ptr(), v.data_ptr())
        if not _bf16_vector(model.norm.weight, cfg.hidden_size):
            return None
        spec = _Model(len(model.layers), heads, kv_heads, head_dim, cfg.hidden_size, cfg.intermediate_size,
                      k0.shape[1], int(kv_int8), model.layers[0].input_layernorm.eps, attn0.scale,
                      k0.stride(0), k0.stride(1), k0.stride(2), cos_sin.data_ptr(), cos_sin.stride(0))
        # compared as the kernels see them (fp32): an eps like 1e-5 is not an fp32 value
        if any(c_float(layer.input_layernorm.eps).value != spec.eps
               or c_float(layer.post_attention_layernorm.eps).value != spec.eps
               for layer in model.layers) or model.norm.eps != model.layers[0].input_layernorm.eps:
            return None
        # what kernels/paged_attention_cpu.py's _prefill_supported asks of the C prefill attention
        prefill = lim.vector and head_dim % 16 == 0 and heads // kv_heads <= PREFILL_MAX_GROUP
        return cls(lib, spec, layers, model.norm.weight, heads * head_dim, kv_heads * head_dim, prefill)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor | None:
        """The final hidden states of a step (``x``: its embeddings, overwritten), or None when this
        step's inputs are not ones the driver takes."""
        m, slots = x.shape[0], meta.slot_mapping
        if (m == 0 or not x.is_contiguous() or x.dtype != torch.bfloat16 or positions.dtype != torch.int64
                or not positions.is_contiguous() or slots.dtype != torch.int64 or not slots.is_contiguous()):
            return None
        rows = self._rows(meta, m)
        if rows is None:
            return None
        s = self.model
        if meta.lora is None:
            s.lora_idx = None
        elif not self._point_at_lora(meta.lora):
            return None
        hidden, inter = s.hidden, s.inter
        widths = (hidden, hidden, self.q_size + 2 * self.kv_size, self.q_size, 2 * inter, inter)
        scratch = torch.empty(m * sum(widths), dtype=torch.bfloat16)
        ptrs, offset = [], 0
        for w in widths:
            ptrs.append(scratch.data_ptr() + offset * 2)
            offset += m * w
        rc = self.lib.pdserve_decode_layers(ctypes.addressof(s), ctypes.addressof(self.layers), self.final_norm.data_ptr(),
                                            m, x.data_ptr(), positions.data_ptr(), slots.data_ptr(),
                                            ctypes.addressof(rows), *ptrs)
        if rc == -1:  # as paged_prefill_attention_cpu reports it
            raise MemoryError("paged prefill attention: no memory for the work list")
        if rc != 0:
            raise RuntimeError(f"the fused decode layers failed (kernel error {rc})")
        return x

    def _rows(self, meta, m: int) -> _Rows | None:
        """The step's decode rows and prefill chunks as the driver takes them (the tensors stay
        alive in ``meta`` for the call), or None where it does not."""
        nd = meta.num_decode_tokens
        rows = _Rows(nd)
        if nd:
            bt, lens = meta.decode_block_tables, meta.decode_context_lens
            if (bt is None or bt.dtype != torch.int32 or bt.stride(1) != 1 or bt.shape[0] != nd
                    or lens.dtype != torch.int32 or not lens.is_contiguous() or lens.shape[0] != nd):
                return None
            rows.block_tables, rows.bt_stride, rows.context_lens = bt.data_ptr(), bt.stride(0), lens.data_ptr()
        if not meta.has_prefill:
            return rows if nd == m else None
        bt, cu, lens = meta.prefill_block_tables, meta.prefill_cu_seqlens_q, meta.prefill_context_lens
        if (not self.prefill or nd >= m or bt.dtype != torch.int32 or bt.stride(1) != 1
                or cu.dtype != torch.int32 or not cu.is_contiguous() or lens.dtype != torch.int32
                or not lens.is_contiguous() or cu.shape[0] != lens.shape[0] + 1 or bt.shape[0] != lens.shape[0]):
            return None
        rows.pf_seqs, rows.pf_block_tables, rows.pf_bt_stride = lens.shape[0], bt.data_ptr(), bt.stride(0)
        rows.pf_cu_seqlens_q, rows.pf_context_lens = cu.data_ptr(), lens.data_ptr()
        return rows

    def _point_at_lora(self, batch) -> bool:
        """This step's adapters (a services.engine.lora_slots.LoRABatch) into the driver, which then
        makes LoRABatch.apply's kernel call after each projection; False where that kernel is not
        the C one (the step stays on the Python path)."""
        from kernels.lora_cpu import lora_apply_cpu
        from kernels.lora_quant import CODES

        slots = batch.slots
        if (slots.kernel is not lora_apply_cpu or slots.dtype != torch.bfloat16 or not slots.a
                or not hasattr(self.lib, "pdserve_lora") or not self.lib.pdserve_lora_available()
                or batch.idx.dtype != torch.int32 or not batch.idx.is_contiguous()):
            return False
        if self._lora_stacks is not slots:  # the stacks are allocated once: point at them once
            for i in range(len(self.layers)):
                for p, proj in enumerate(("qkv", "o", "gate_up", "down")):
                    self.layers[i].lora_a[p] = slots.a[proj][i].data_ptr()
                    self.layers[i].lora_bt[p] = slots.bt[proj][i].data_ptr()
                    if slots.a_scale:  # a quantized store
                        self.layers[i].lora_as[p] = slots.a_scale[proj][i].data_ptr()
                        self.layers[i].lora_bs[p] = slots.bt_scale[proj][i].data_ptr()
            self._lora_stacks = slots
        s = self.model
        s.lora_idx, s.lora_ranks, s.lora_rank = batch.idx.data_ptr(), slots.ranks.data_ptr(), slots.max_rank
        s.lora_fmt = CODES[slots.fmt]
        return True
