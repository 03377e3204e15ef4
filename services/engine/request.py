"""A request's state inside one engine: tokens, progress, blocks. Plain data, no torch."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from services.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    RESERVED = "reserved"  # decode side: blocks held, waiting for KV from a prefill worker
    PREFILLED = "prefilled"  # prefill-only: done, blocks held until the caller releases them
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower runs first
    prefill_only: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_ids: tuple[int, ...] = ()

    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of full blocks, in order
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache
    # Running only: leading blocks up to which this request has announced it is computing the
    # prompt; those from num_cached_blocks on are in KVManager's in-progress set until cached or freed.
    num_claimed_blocks: int = 0
    num_prefix_hit_tokens: int = 0  # from the prefix cache at (latest) admission
    num_restored_tokens: int = 0  # of those, copied back from the spill tier
    # Waiting only: blocks being copied back from the spill tier (KVManager.Restore); the request
    # holds them and is admitted once the copy is done
    restore: object | None = None
    num_preemptions: int = 0
    # Speculative decoding: draft tokens to verify in the next step (never part of all_token_ids
    # until the model accepts them); set by the engine's Speculator, read by the scheduler.
    spec_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    first_token_time: float | None = None
    # LoRA: the slot this request's adapter holds while it runs (-1: none, or not yet acquired)
    # and the namespace its blocks hash in (services/engine/block_hash.request_namespace)
    lora_slot: int = -1
    namespace: str | None = None
    # n choices (Engine.add_choices): the other choices of this prompt, waiting outside the scheduler
    # until this request's prompt is computed, then forked off it (services/engine/choices.py)
    forks: list["Request"] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
