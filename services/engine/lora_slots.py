"""The engine's LoRA adapters: the ones it knows (name -> PEFT directory) and the ``max_loras`` it
holds in slots, stacked per layer and projection for the batched kernel (kernels/lora.py).

A request holds (pins) its adapter's slot from admission until it finishes. An adapter that is
not in a slot is loaded on demand into a free slot or over the least recently used unpinned one;
when every slot is pinned by running requests the request waits (the engine retries each step).
Ranks below ``max_rank`` are zero-padded in the stacks and skipped by the kernels; each adapter's
scaling is folded into its B. With ``lora_dtype`` int8 or int4 (opt-in: it changes the numbers)
the stacks hold each adapter quantized at load, with scales beside them (kernels/lora_quant.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from kernels.lora_quant import GROUP, check_shapes, quantize_int4_groups, quantize_int8_rows
from services.engine.lora_config import MODULES, WEIGHTS_FILE, LoRASpec, read_lora
from services.errors import InvalidRequestError

RANKS = (8, 16, 32, 64, 128, 256)  # --max-lora-rank: a power of two (the Triton kernels' block)


@dataclass
class LoRABatch:
    """One forward's adapters: a slot per input row (-1: the base model)."""

    slots: "LoRASlots"
    idx: torch.Tensor  # int32 [T]

    def apply(self, layer: int, proj: str, y: torch.Tensor, x: torch.Tensor) -> None:
        s = self.slots
        scales = None if s.fmt == "bf16" else (s.a_scale[proj][layer], s.bt_scale[proj][layer])
        s.kernel(y, x, s.a[proj][layer], s.bt[proj][layer], s.bounds[proj], self.idx, s.ranks, scales=scales)


class LoRASlots:
    def __init__(self, model, max_loras: int, max_rank: int, kernel, dtype: torch.dtype, device, fmt: str = "bf16"):
        if max_rank not in RANKS:
            raise ValueError(f"max_lora_rank must be one of {', '.join(map(str, RANKS))}; got {max_rank}")
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        cfg = model.config
        q, kv, h, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, \
            cfg.intermediate_size
        # projection -> (input size, output segment bounds)
        self.shapes = {"qkv": (h, (0, q, q + kv, q + 2 * kv)), "o": (q, (0, h)),
                       "gate_up": (h, (0, inter, 2 * inter)), "down": (inter, (0, h))}
        self.bounds = {p: b for p, (_, b) in self.shapes.items()}
        check_shapes(fmt, self.shapes)
        self.fmt = fmt  # "bf16": the stacks in ``dtype`` (the model's); "int8" / "int4": quantized
        self.num_layers, self.max_loras, self.max_rank = cfg.num_layers, max_loras, max_rank
        self.kernel, self.dtype, self.device = kernel, dtype, torch.device(device)
        self.a: dict[str, torch.Tensor] = {}  # proj -> [L, S, nseg * R, K], allocated at the first load
        self.bt: dict[str, torch.Tensor] = {}  # proj -> [L, S, R, N]
        self.a_scale: dict[str, torch.Tensor] = {}  # quantized stacks' scales (kernels/lora_quant.py)
        self.bt_scale: dict[str, torch.Tensor] = {}
        self.ranks = torch.zeros(max_loras, dtype=torch.int32, device=self.device)
        self.known: dict[str, LoRASpec] = {}
        self.loaded: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self.pins = [0] * max_loras
        self.loads = 0  # adapters read from disk into a slot (on demand ones included)

    # ---- which adapters exist ------------------------------------------
    def register(self, name: str, path: str) -> LoRASpec:
        """Know an adapter (its config checked now, its tensors read when a request needs it).
        The same name with another path is refused: cached KV blocks are keyed by the name."""
        spec = read_lora(name, path, self.max_rank)
        old = self.known.get(name)
        if old is not None and old.path != spec.path:
            raise InvalidRequestError(f"adapter {name!r} is already loaded from {old.path}; unload it first",
                                      param="lora_name")
        self.known[name] = spec
        return spec

    def unregister(self, name: str) -> bool:
        """Forget an adapter; its slot is freed once no request pins it (False: it was unknown)."""
        if self.known.pop(name, None) is None:
            return False
        slot = self.loaded.get(name)
        if slot is not None and not self.pins[slot]:
            del self.loaded[name]
            self.ranks[slot] = 0
        return True

    def names(self) -> list[str]:
        return sorted(self.known)

    # ---- slots ----------------------------------------------------------
    def acquire(self, name: str) -> int | None:
        """Pin ``name``'s slot, loading it if needed; None while every slot is pinned by others."""
        if name not in self.known:
            raise InvalidRequestError(f"unknown LoRA adapter {name!r}", param="model")
        slot = self.loaded.get(name)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            self._load(self.known[name], slot)
            self.loaded[name] = slot
        self.loaded.move_to_end(name)
        self.pins[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        self.pins[slot] -= 1
        if not self.pins[slot]:  # an adapter unregistered while pinned goes now
            name = next((n for n, s in self.loaded.items() if s == slot), None)
            if name is not None and name not in self.known:
                del self.loaded[name]
                self.ranks[slot] = 0

    def _free_slot(self) -> int | None:
        used = set(self.loaded.values())
        free = next((s for s in range(self.max_loras) if s not in used), None)
        if free is not None:
            return free
        victim = next((n for n, s in self.loaded.items() if not self.pins[s]), None)  # LRU first
        if victim is None:
            return None
        return self.loaded.pop(victim)

    def allocate(self) -> None:
        """The stacks, now (else at the first adapter's load): a CUDA graph captured over them keeps
        their addresses, which loads then write into."""
        if not self.a:
            self._allocate()

    def _allocate(self) -> None:
        L, S, R = self.num_layers, self.max_loras, self.max_rank
        dev = self.device
        for proj, (k, bounds) in self.shapes.items():
            nseg, n = len(bounds) - 1, bounds[-1]
            if self.fmt == "bf16":
                self.a[proj] = torch.zeros(L, S, nseg * R, k, dtype=self.dtype, device=dev)
                self.bt[proj] = torch.zeros(L, S, R, n, dtype=self.dtype, device=dev)
            elif self.fmt == "int8":
                self.a[proj] = torch.zeros(L, S, nseg * R, k, dtype=torch.int8, device=dev)
                self.bt[proj] = torch.zeros(L, S, R, n, dtype=torch.int8, device=dev)
                self.a_scale[proj] = torch.zeros(L, S, nseg * R, dtype=torch.float32, device=dev)
                self.bt_scale[proj] = torch.zeros(L, S, nseg * R, dtype=torch.float32, device=dev)
            else:  # int4: two a byte; scale 0 makes a zeroed group 0 whatever its nibbles
                self.a[proj] = torch.zeros(L, S, nseg * R, k // 2, dtype=torch.uint8, device=dev)
                self.bt[proj] = torch.zeros(L, S, R, n // 2, dtype=torch.uint8, device=dev)
                self.a_scale[proj] = torch.zeros(L, S, nseg * R, k // GROUP, dtype=torch.bfloat16, device=dev)
                self.bt_scale[proj] = torch.zeros(L, S, R, n // GROUP, dtype=torch.bfloat16, device=dev)

    def _load(self, spec: LoRASpec, slot: int) -> None:
        if not self.a:
            self._allocate()
        self.ranks[slot] = 0
        try:
            tensors = load_file(f"{spec.path}/{WEIGHTS_FILE}")
        except Exception as exc:  # a truncated or foreign file: the request's error, not the worker's
            raise InvalidRequestError(f"adapter {spec.name!r}: {WEIGHTS_FILE} does not load ({exc})",
                                      param="lora_path") from None
        for stacks in (self.a, self.bt, self.a_scale, self.bt_scale):
            for t in stacks.values():
                t[:, slot].zero_()
        r, R = spec.rank, self.max_rank
        seen = 0
        for key, value in tensors.items():
            layer, module, which = _parse_key(key)
            if module not in MODULES or which is None:
                raise InvalidRequestError(f"adapter {spec.name!r}: tensor {key!r} is not a LoRA A/B of a "
                                          "Llama projection", param="lora_path")
            if not 0 <= layer < self.num_layers:
                raise InvalidRequestError(f"adapter {spec.name!r}: tensor {key!r} names layer {layer}; "
                                          f"the model has {self.num_layers}", param="lora_path")
            proj, seg = MODULES[module]
            k, bounds = self.shapes[proj]
            lo, hi = bounds[seg], bounds[seg + 1]
            want = (r, k) if which == "A" else (hi - lo, r)
            if tuple(value.shape) != want:
                raise InvalidRequestError(f"adapter {spec.name!r}: {key} has shape {tuple(value.shape)}, this model "
                                          f"needs {want} (an adapter for another base model?)", param="lora_path")
            if which == "A":
                self._put_a(proj, layer, slot, seg, value.float())
            else:  # B^T with the scaling folded in, in fp32 before the one rounding
                self._put_bt(proj, layer, slot, seg, lo, hi, (value.float() * spec.scaling).T)
            seen += 1
        if not seen:
            raise InvalidRequestError(f"adapter {spec.name!r} has no LoRA tensors", param="lora_path")
        self.ranks[slot] = r
        self.loads += 1


    def _put_a(self, proj: str, layer: int, slot: int, seg: int, w: torch.Tensor) -> None:
        """Segment ``seg``'s A [r, K] into the slot, in the stacks' format."""
        rows = slice(seg * self.max_rank, seg * self.max_rank + w.shape[0])
        if self.fmt == "bf16":
            self.a[proj][layer, slot, rows] = w.to(self.dtype)
            return
        q, scale = quantize_int8_rows(w) if self.fmt == "int8" else quantize_int4_groups(w)
        self.a[proj][layer, slot, rows] = q
        self.a_scale[proj][layer, slot, rows] = scale

    def _put_bt(self, proj: str, layer: int, slot: int, seg: int, lo: int, hi: int, w: torch.Tensor) -> None:
        """Segment ``seg``'s B^T [r, hi - lo] (columns lo:hi) into the slot, in the stacks' format."""
        r = w.shape[0]
        if self.fmt == "bf16":
            self.bt[proj][layer, slot, :r, lo:hi] = w.to(self.dtype)
        elif self.fmt == "int8":  # one scale per rank row of this segment
            q, scale = quantize_int8_rows(w)
            self.bt[proj][layer, slot, :r, lo:hi] = q
            self.bt_scale[proj][layer, slot, seg * self.max_rank:seg * self.max_rank + r] = scale
        else:
            q, scale = quantize_int4_groups(w)
            self.bt[proj][layer, slot, :r, lo // 2:hi // 2] = q
            self.bt_scale[proj][layer, slot, :r, lo // GROUP:hi // GROUP] = scale


def _parse_key(key: str) -> tuple[int, str, str | None]:
    """``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` -> (3, "q_proj", "A")."""
    parts = key.split(".")
    try:
        i = parts.index("layers")
        layer = int(parts[i + 1])
    except (ValueError, IndexError):
        return -1, "", None
    which = "A" if "lora_A" in parts else "B" if "lora_B" in parts else None
    module = next((p for p in parts if p in MODULES), "")
    return layer, module, which
