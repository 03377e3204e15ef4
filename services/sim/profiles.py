"""What a modelled worker costs: prefill time, decode step time, KV capacity, transfer, start-up.

A ``WorkerProfile`` is read from the calibration file (``calibration.json`` beside
this module, ``--calibration`` to use another), one entry per hardware profile:

* ``cpu``: measured on the project's CPU machine by ``python -m services.sim.calibrate``
  (the real engine, the default model, one torch thread per worker, as ``pdserve bench
  routing`` runs its workers), plus the KV transfer rate and hop latency of ``pdserve
  bench kvtransfer`` / ``routing`` (BENCHMARKS.md).
* ``h100``: Llama-3.1-8B in bf16 on one H100 SXM, a roofline from the published
  datasheet figures (HBM3 3.35 TB/s, 989 dense bf16 TFLOP/s; ConnectX-7 400 Gb/s) at
  stated efficiencies: derived, not measured.
* ``h200``: Llama-3.1-8B's shapes (random weights) in bf16 on a lent H200, prefill and decode
  measured by ``python -m services.sim.calibrate --device cuda`` (CUDA graphs, wall clock), its
  KV capacity the engine's, its cold start measured there too (35.3 s from launch to a first request
  with 16 GB of weights read from local disk: ``benchmarks/probes/gpu_cold_start.py``); the KV
  transfer and the warm start kept from ``h100``.
* ``h100-measured``: the same measurement on a lent H100 80GB HBM3; what one engine does not
  measure (KV transfer, start-up times, max_num_seqs) kept from ``h100``. Against the derived
  ``h100`` its decode steps are 1.04-1.31x faster, its prefill of 1k-8k tokens 1.3-1.45x faster,
  and its prefill of under 512 new tokens (cached prefix or not) 2-6x slower: pdserve's eager
  prefill costs ~27 ms on that machine whatever the size (host-bound kernel launches).

Cost models (seconds)::

    prefill(new, context) = base + per_token * new + per_token_context * new * context
    decode_step(B, sum_ctx) = base + per_seq * B + per_seq_context * sum_ctx
    transfer(tokens)      = latency + min(tokens, chunk_tokens) * kv_bytes_per_token / bytes_per_s

(pdserve streams KV while the prefill computes, so only the last chunk's transfer is on the
way to the first token.)
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

CALIBRATION = Path(__file__).with_name("calibration.json")


@dataclass(frozen=True)
class WorkerProfile:
    name: str
    prefill_base_s: float
    prefill_per_token_s: float
    prefill_per_token_context_s: float
    decode_base_s: float
    decode_per_seq_s: float
    decode_per_seq_context_s: float
    kv_blocks: int  # KV blocks per worker (prefill workers: their prefix cache)
    block_size: int
    kv_bytes_per_token: int
    transfer_latency_s: float
    transfer_bytes_per_s: float
    transfer_chunk_tokens: int
    max_num_seqs: int
    cold_start_s: float  # process start to registered and ready (model load included)
    warm_start_s: float  # a standby worker (model loaded, not registered) to ready
    # >0: prefill workers run the engine's steps (prefill_steps.py): this many prompt tokens per step,
    # at most prefill_chunk_tokens from one request; 0: one whole prompt at a time (workers.py)
    prefill_step_tokens: int = 0
    prefill_chunk_tokens: int = 0
    host_cores: int = 0  # cores of the machine the profile's real runs shared (the validation's host, host.py)
    # CPU seconds per request of the processes beside the workers on that host (router, Redis, client;
    # host.py FrontDoor), measured by pdserve bench routing from /proc; only with host_cores
    frontdoor_cpu_s: float = 0.0
    frontdoor_busy_cores: float = 0.0  # and what they use whether requests come or not (heartbeats, polls)
    # a served worker's CPU over the engine's own compute (gRPC, the KV send, its event loop), per role,
    # measured by bench routing (/proc) against the modelled compute of the same requests; the validation's
    worker_cpu_factor: dict = field(default_factory=dict, compare=False)
    # the decode worker's CPU beyond its engine steps (its event loop: the tokens streamed out, the KV received),
    # as a share of the steps' compute, run beside them on a shared host (host.py: the worker counts 1 + share
    # runnable threads); served() moves the decode worker's measured factor here (a step is the engine's alone)
    decode_loop_cpu_share: float = 0.0
    # CPU seconds a prefill worker spends per request beyond the engine's steps (the call, the whole prompt's
    # KV sent: a prefix hit sends it too), in the step that finishes the request's prompt; served() sets it
    # from worker_cpu_factor's "prefill_per_request_s"
    prefill_request_s: float = 0.0
    # a disaggregated request's first token leaves the decode worker when its step under way ends (the cpu
    # profile: pdserve's decode worker, whose engine thread holds the GIL through a step); else on arrival
    first_token_at_step: bool = False
    source: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("prefill_per_token_s", "decode_base_s", "transfer_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"profile {self.name}: {name} must be > 0")
        if self.kv_blocks < 2 or self.block_size < 1 or self.max_num_seqs < 1:
            raise ValueError(f"profile {self.name}: kv_blocks >= 2, block_size >= 1 and max_num_seqs >= 1 needed")

    def prefill_s(self, new_tokens: int, context: int) -> float:
        if new_tokens <= 0:
            return self.prefill_base_s
        return (self.prefill_base_s + self.prefill_per_token_s * new_tokens
                + self.prefill_per_token_context_s * new_tokens * context)

    def decode_step_s(self, batch: int, sum_context: float) -> float:
        return self.decode_base_s + self.decode_per_seq_s * batch + self.decode_per_seq_context_s * sum_context

    def transfer_s(self, tokens: int) -> float:
        last = min(tokens, self.transfer_chunk_tokens)
        return self.transfer_latency_s + last * self.kv_bytes_per_token / self.transfer_bytes_per_s

    def served(self) -> WorkerProfile:
        """The costs of a served worker on the profile's host, from its measured ``worker_cpu_factor``.

        A prefill worker's steps cost the engine's times its factor, and each request adds
        ``prefill_per_request_s`` to the step that finishes its prompt: its serving work (the call, the
        whole prompt's KV sent after the last chunk, a prefix hit's as much as a miss's) is on the
        request's way to its first token. A decode
        worker's steps cost the engine's alone, and the rest of its factor is its event loop's
        (``decode_loop_cpu_share``): the tokens it streams out while the next step computes, a thread
        beside the engine's that takes cores from the others, not time from the step
        (``benchmarks/probes/kvaware_ttft_join.py``: with the factor on the step, kv-aware's simulated
        steps were ~20% longer and its first tokens ~20% earlier than measured, at the same throughput)."""
        f, d = self.worker_cpu_factor.get("prefill", 1.0), self.worker_cpu_factor.get("decode", 1.0)
        return dataclasses.replace(
            self, prefill_base_s=self.prefill_base_s * f, prefill_per_token_s=self.prefill_per_token_s * f,
            prefill_per_token_context_s=self.prefill_per_token_context_s * f,
            prefill_request_s=self.worker_cpu_factor.get("prefill_per_request_s", 0.0),
            decode_loop_cpu_share=max(0.0, d - 1.0))

    def with_kv_blocks(self, kv_blocks: int) -> WorkerProfile:
        fields = {k: v for k, v in self.__dict__.items()}
        fields["kv_blocks"] = kv_blocks
        return WorkerProfile(**fields)


def load_profiles(path: str | Path | None = None) -> dict[str, WorkerProfile]:
    data = json.loads(Path(path or CALIBRATION).read_text())
    out = {}
    for name, p in data["profiles"].items():
        out[name] = WorkerProfile(
            name=name,
            prefill_base_s=p["prefill_s"]["base"], prefill_per_token_s=p["prefill_s"]["per_token"],
            prefill_per_token_context_s=p["prefill_s"]["per_token_context"],
            decode_base_s=p["decode_step_s"]["base"], decode_per_seq_s=p["decode_step_s"]["per_seq"],
            decode_per_seq_context_s=p["decode_step_s"]["per_seq_context"],
            kv_blocks=p["kv_blocks"], block_size=p["block_size"], kv_bytes_per_token=p["kv_bytes_per_token"],
            transfer_latency_s=p["transfer"]["latency_s"], transfer_bytes_per_s=p["transfer"]["bytes_per_s"],
            transfer_chunk_tokens=p["transfer"]["chunk_tokens"], max_num_seqs=p["max_num_seqs"],
            cold_start_s=p["cold_start_s"], warm_start_s=p["warm_start_s"],
            prefill_step_tokens=p.get("prefill_step_tokens", 0), prefill_chunk_tokens=p.get("prefill_chunk_tokens", 0),
            host_cores=p.get("host_cores", 0), frontdoor_cpu_s=p.get("frontdoor_cpu_s", 0.0),
            frontdoor_busy_cores=p.get("frontdoor_busy_cores", 0.0),
            worker_cpu_factor=p.get("worker_cpu_factor", {}),
            first_token_at_step=p.get("first_token_at_step", False),
            source=p.get("source", {}))
    return out


def load_profile(name: str, path: str | Path | None = None, cold_start_s: float | None = None) -> WorkerProfile:
    """The calibration file's profile ``name``; ``cold_start_s``: with this cold start (real seconds) instead."""
    profiles = load_profiles(path)
    if name not in profiles:
        raise ValueError(f"unknown worker profile {name!r}; the calibration file has {', '.join(sorted(profiles))}")
    if cold_start_s is None:
        return profiles[name]
    if not cold_start_s > 0:
        raise ValueError(f"a cold start must be positive seconds, got {cold_start_s}")
    return dataclasses.replace(profiles[name], cold_start_s=cold_start_s)
