"""What ``pdserve up`` runs where its flags leave it open, chosen from the machine's cores by measurement.

    choice = choose(cpus=os.cpu_count(), gguf=gguf_servable(path))   # nothing given: all chosen
    choice.prefill, choice.decode, choice.threads, choice.quantization, choice.reasons

Flags (and their ``PDSERVE_*`` variables) always win: only what the user left
open is chosen, and each choice says why (``pdserve up`` prints
``chose: ... because ...``). The figures behind the choices are in
BENCHMARKS.md ("Defaults for small machines"), measured with ``pdserve bench
peer --only pdserve --variant ...`` on the project's 2-core machine
(benchmarks/results/peer-20261126T015655Z.json and the paired run after it):

- **Processes**: one prefill and one decode worker from 2 cores up: with fresh
  prompts at 16 and 32 streams the separate prefill process kept the decode
  batch running while prompts were computed, and served more tokens per second
  than one aggregated worker. A single core cannot run the two side by side, so
  there the decode worker prefills its own prompts (not measured).
- **Threads per worker**: every core, as torch would pick on its own (now said
  and explicit): on 2 cores, 2 threads per worker beat 1 at one stream (the
  worker that computes gets both cores while the other waits) and under load.
- **Conditional disaggregation**: the router prefills an uncached prompt of up
  to ``LOCAL_PREFILL_MAX_TOKENS`` tokens on its decode worker when that worker
  has nothing waiting (``--local-prefill-max-tokens``; the router's own default
  stays 0 for deployments that configure it): at 16 and 32 streams this served
  more tokens per second and cut a lone cached prompt's TTFT.
- **Scheduling**: the engine workers' autogroups at niceness ``ENGINE_NICE``
  (``--engine-nice``; no privilege needed): every child runs in a session of its
  own, and with ``kernel.sched_autogroup_enabled`` a session shares the cores as
  one group, so this is what lets the gateway, router and Redis take a core as
  soon as they wake while the workers compute. ``pdserve bench frontdoor``,
  quiet, with this stack: added p99 per chunk at 1,000 open streams 28-40 ms
  against 634 ms at the kernel's default, with the same wall time for its 1,500
  requests (eleventh session; 17-26 ms in the twelfth's six runs with the 20 ms
  stream flush and the bench's quiet collector: BENCHMARKS.md).
  The workers then yield to anything else on the machine too; ``--engine-nice
  0`` keeps the kernel's default. ``--front-first`` (services/front_first.py) is
  opt-in: 21.5-22.1 ms in two quiet runs, not yet enough runs for a default.
- **Weights**: a GGUF model whose projections are all Q4_0/Q4_1/Q8_0 blocks is
  served from those blocks (``--quantization gguf``): the same weights the file
  holds (bf16 holds the same values, widened), decoded at 2-3 times the speed on
  the CPU kernels, and batched greedy outputs matched batch 1 in the bench's
  check where bf16's did not. Anything else stays in ``--dtype``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

ENGINE_NICE = 19  # the engine workers' autogroup niceness under `pdserve up` (measured; see Scheduling above)
LOCAL_PREFILL_MAX_TOKENS = 256  # the router's conditional-disaggregation threshold under `pdserve up` (measured)
AGGREGATED_CPUS = 1  # at most this many cores: the decode worker prefills (no core for a prefill process)
# the block types --quantization gguf serves (kernels/gguf_linear.KINDS; a test keeps the two equal,
# so deciding here does not import torch)
GGUF_SERVABLE = ("Q4_0", "Q4_1", "Q8_0")
_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@dataclass
class Choice:
    prefill: int
    decode: int
    threads: int
    quantization: str | None  # None: unquantized (--dtype)
    router_args: list[str] = field(default_factory=list)  # the router flags chosen here
    front_first: bool = False  # the gateway, router and Redis on short slices (front_first.py; --front-first)
    engine_nice: int = 0  # the engine workers' autogroup niceness (0: the kernel's default)
    realtime_gateway: bool = False  # the gateway's loop thread in the real-time class (realtime_loop.py)
    reasons: list[str] = field(default_factory=list)  # one "chose X because Y" per value chosen here

    def summary(self) -> str:
        return "; ".join(self.reasons)


def gguf_servable(path: Path | None) -> tuple[bool, str]:
    """Whether ``--quantization gguf`` can serve this model file, and why not."""
    if path is None or path.suffix != ".gguf":
        return False, "the model is not a .gguf file"
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
    except Exception as exc:  # an unreadable file is the loader's error to report, not a defaults question
        return False, f"{path.name} could not be read ({type(exc).__name__})"
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    names = [n for n in kinds if n.startswith("blk.") and n.split(".")[2] in _PROJECTIONS]
    names.append("output.weight" if "output.weight" in kinds else "token_embd.weight")
    other = sorted({kinds.get(n, "missing") for n in names} - set(GGUF_SERVABLE))
    if not names[:-1] or other:
        return False, f"{path.name} stores projections as {', '.join(other) or 'none'}"
    for fused in (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up")):  # one GGUFLinear each: one block type
        for layer in {n.split(".")[1] for n in names[:-1]}:
            if len({kinds.get(f"blk.{layer}.{part}.weight") for part in fused}) > 1:
                return False, f"{path.name} mixes block types within layer {layer}'s {'/'.join(fused)}"
    return True, f"{path.name}'s projections are {'/'.join(sorted({kinds[n] for n in names}))} blocks"


def choose(cpus: int, *, prefill: int | None = None, decode: int | None = None, threads: int | None = None,
           quantization: str | None = None, gguf: tuple[bool, str] = (False, ""),
           local_prefill_given: bool = False, front_first: bool = False, engine_nice: int | None = None,
           realtime_gateway: bool | None = None) -> Choice:
    """Fill in what was not given (None) for a machine of ``cpus`` cores; ``gguf``: ``gguf_servable``'s answer.
    ``quantization`` "none" is an explicit choice of unquantized weights. ``local_prefill_given``: the router's
    ``--local-prefill-max-tokens`` was passed (``--router-arg``); ``front_first``: ``--front-first`` given
    (said with the choices); ``engine_nice``: ``--engine-nice`` (None: not given); ``realtime_gateway``: False
    with ``--no-realtime-gateway`` (None: not given)."""
    cpus = max(1, cpus)
    reasons = []
    if prefill is None:
        prefill = 0 if cpus <= AGGREGATED_CPUS else 1
        reasons.append(f"{prefill} prefill worker{'s' * (prefill != 1)} because {cpus} core{'s' * (cpus != 1)} "
                       + ("cannot run prefill beside decode" if prefill == 0
                          else "measured faster disaggregated under load (BENCHMARKS.md)"))
    if decode is None:
        decode = 1
    if threads is None:
        threads = cpus
        reasons.append(f"{threads} thread{'s' * (threads != 1)} per worker because {cpus} core{'s' * (cpus != 1)}: "
                       "a worker computing gets them all while the other waits (measured)")
    if quantization is None:
        ok, why = gguf
        quantization = "gguf" if ok else "none"
        reasons.append(f"{quantization} weights because {why}" + (" (the file's own blocks, faster on CPU)"
                                                                    if ok else ""))
    router_args = []
    if prefill > 0 and not local_prefill_given:
        router_args = [f"--local-prefill-max-tokens={LOCAL_PREFILL_MAX_TOKENS}"]
        reasons.append(f"uncached prompts up to {LOCAL_PREFILL_MAX_TOKENS} tokens prefilled on an idle decode worker "
                       "because the hand-off cost more than the compute (measured)")
    if engine_nice is None:
        engine_nice = ENGINE_NICE
        reasons.append(f"the workers' autogroups at niceness {engine_nice} because the gateway, router and Redis "
                       "then get a core when they wake (measured: p99 per chunk at 1,000 streams 17-40 ms, not "
                       "634; --engine-nice 0 to keep the kernel's default)")
    if realtime_gateway is None:
        realtime_gateway = True
        reasons.append("the gateway's event loop in the real-time class where allowed (root or CAP_SYS_NICE), and "
                       "back to ordinary for 2 s whenever it runs 0.5 s without waiting, because it then never "
                       "waits for a core behind the workers (measured: p99 per chunk at 1,000 streams 4.1-6.5 ms, "
                       "not 16.8-20.6; --no-realtime-gateway to keep it ordinary)")
    if front_first:
        from services import front_first as scheduling

        reasons.append(scheduling.describe())
    return Choice(prefill, decode, threads, None if quantization == "none" else quantization,
                  router_args=router_args, front_first=front_first, engine_nice=engine_nice,
                  realtime_gateway=realtime_gateway, reasons=reasons)
