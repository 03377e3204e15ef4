"""Architecture of a Llama-family checkpoint, read from its HF ``config.json``.

Covers Llama 2/3, SmolLM2, Mistral and Qwen2: GQA, RoPE (theta and scaling),
RMSNorm, SwiGLU, tied embeddings, optional qkv bias. Presets name well-known
shapes for ``dummy:<preset>`` random-weight models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; pdserve serves {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type", "llama")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        # transformers >= 5 nests rope settings under rope_parameters.
        rope = cfg.get("rope_parameters") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        max_pos = cfg.get("max_position_embeddings", 4096)
        # pdserve attends to the whole context. A sliding window changes attention only past its
        # width, so capping the context at the window keeps every output exact (Mistral v0.1:
        # 4096 of 32768). Qwen2 declares a window but uses it only with use_sliding_window.
        use_window = cfg.get("use_sliding_window")
        if use_window is None:
            use_window = model_type == "mistral"
        if use_window and cfg.get("sliding_window"):
            max_pos = min(max_pos, cfg["sliding_window"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            max_position_embeddings=max_pos,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=dict(scaling) if scaling else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            eos_token_ids=eos_ids,
            model_type=model_type,
        )


# Shapes of public checkpoints, for dummy:<preset> (random weights, no tokenizer files).
PRESETS: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
        tie_word_embeddings=True, eos_token_ids=(2,),
    ),
    "llama-3.2-1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=True, eos_token_ids=(128001, 128008, 128009),
    ),
    "llama-3.1-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        eos_token_ids=(128001, 128008, 128009),
    ),
    "qwen2-0.5b": dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
        num_kv_heads=2, head_dim=64, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=True, eos_token_ids=(151645,),
        model_type="qwen2",
    ),
    "tiny": dict(  # for fast tests
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=1024, eos_token_ids=(1,),
    ),
}


def preset_config(name: str) -> ModelConfig:
    try:
        return ModelConfig(**PRESETS[name])
    except KeyError:
        raise ValueError(f"unknown dummy preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
