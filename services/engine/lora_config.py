"""A LoRA adapter in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``), read
and checked without torch: the gateway checks an adapter the admin endpoint is asked to load with
this, the workers before they read its tensors (services/engine/lora_slots.py).

What is served: plain LoRA (``lora_A`` / ``lora_B``, scaling ``lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with ``use_rslora``) on any of the Llama projections q/k/v/o and
gate/up/down. Refused with a message naming the setting: DoRA, trained biases, extra trained
modules (``modules_to_save``), per-module rank or alpha patterns, ``fan_in_fan_out``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from services.errors import InvalidRequestError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's module name -> (our fused projection, its output segment)
MODULES = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@-]{0,127}$")


@dataclass(frozen=True)
class LoRASpec:
    name: str
    path: str
    rank: int
    scaling: float
    modules: tuple[str, ...]  # PEFT module names it trains, e.g. ("q_proj", "v_proj")
    base_model: str | None


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequestError(f"adapter name {name!r} must be 1-128 letters, digits or ._:/@- "
                                  "(starting with a letter or digit)", param="lora_name")
    return name


def parse_lora_flag(value: str) -> tuple[str, str]:
    """``NAME=PATH`` (a ``--lora`` flag) -> (name, path)."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora takes NAME=PATH (a PEFT adapter directory), got {value!r}")
    check_name(name)
    return name, path


def read_lora(name: str, path: str, max_rank: int | None = None) -> LoRASpec:
    """The adapter's config, checked; InvalidRequestError (param ``lora_path``) naming the problem."""
    check_name(name)

    def bad(why: str) -> InvalidRequestError:
        return InvalidRequestError(f"adapter {name!r} at {path}: {why}", param="lora_path")

    directory = Path(path)
    if not (directory / CONFIG_FILE).is_file():
        raise bad(f"no {CONFIG_FILE} (a PEFT adapter directory holds it and {WEIGHTS_FILE})")
    if not (directory / WEIGHTS_FILE).is_file():
        raise bad(f"no {WEIGHTS_FILE} (adapters saved as .bin are not read; save with safe_serialization)")
    try:
        cfg = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise bad(f"{CONFIG_FILE} is not readable JSON ({exc})") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise bad(f"peft_type {cfg.get('peft_type') if isinstance(cfg, dict) else cfg!r} is not LORA")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise bad(f"r must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise bad(f"lora_alpha must be a number, got {alpha!r}")
    if max_rank is not None and rank > max_rank:
        raise bad(f"rank {rank} is above --max-lora-rank {max_rank}; start the workers with a larger one")
    for key, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights"),
                     ("modules_to_save", "extra trained modules (modules_to_save)"),
                     ("rank_pattern", "per-module ranks (rank_pattern)"),
                     ("alpha_pattern", "per-module alphas (alpha_pattern)")):
        if cfg.get(key):
            raise bad(f"{why} is not supported")
    if cfg.get("bias", "none") != "none":
        raise bad(f"trained biases (bias={cfg['bias']!r}) are not supported")
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):  # a regex over module paths
        modules = tuple(m for m in MODULES if re.search(targets, f"model.layers.0.x.{m}"))
    else:
        modules = tuple(t for t in targets if t in MODULES)
        unknown = sorted(set(targets) - set(MODULES))
        if unknown:
            raise bad(f"target_modules {unknown} are not LoRA-able here (q/k/v/o_proj, gate/up/down_proj)")
    if not modules:
        raise bad(f"target_modules {targets!r} names none of q/k/v/o_proj, gate/up/down_proj")
    scaling = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    return LoRASpec(name, str(directory), rank, float(scaling), modules, cfg.get("base_model_name_or_path"))
