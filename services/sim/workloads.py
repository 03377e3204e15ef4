"""Synthetic request streams shaped to published production-trace statistics.

A request is its arrival time, priority tier, the hashes of its prompt's full KV
blocks, its prompt length and its output length. Block hashes are what the real
router sees: shared content (a system prompt, a document, a conversation's
history) has the same chained hashes wherever it recurs, so the real
``PrefixIndex`` and policies see real sharing. The simulator never makes token
ids: a block is an int, a chain of shared blocks is memoised per (parent,
content), and a request's own blocks are fresh ints from a counter.

Mixes (lengths in tokens; lognormal draws are given by their median and sigma):

* ``chat``: multi-turn conversations with growing history (each turn's prompt is
  the previous prompt + its answer + a new user message) under one of 20 system
  prompts. Per-turn lengths follow the Azure LLM inference trace 2023
  "conversation" set as reported by Splitwise (Patel et al., ISCA 2024,
  arXiv:2311.18677): prompt median 1,020, output median 129 tokens.
* ``system-prompt``: one-shot requests from a population of 100 applications,
  each with its own 1-3k-token system prompt, popularity Zipf(1.0).
* ``rag``: a retrieved document from a pool of 10,000 (popularity Zipf(1.1)) plus
  a question; document sizes give Mooncake's trace averages (Qin et al.,
  "Mooncake", FAST 2025, arXiv:2407.00079: average input 7,590 and output 182
  tokens over 23,608 requests in one hour).
* ``agent``: coding-agent sessions: a shared tool/system preamble, a repository
  context per session, then steps that each append a tool result and get a short
  answer, seconds apart (the Azure 2023 "code" set: prompt median 1,500, output
  median 13 tokens).

Arrivals: sessions start as a Poisson process whose rate follows a diurnal sine
(``diurnal_amplitude``, ``period_s``) with bursts (``burst_factor`` times the
rate for ``burst_s``, ``bursts_per_period`` of them at seeded random times).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import dataclass, field

from services.sim.events import collector_paused

TIERS = ("interactive", "standard", "batch")
MIXES = ("chat", "system-prompt", "rag", "agent")


@dataclass(slots=True)
class SimRequest:
    id: int
    arrival: float
    tier: str
    hashes: list[int]
    num_tokens: int
    out_tokens: int
    kind: str = ""
    model: str = ""


@dataclass
class ArrivalShape:
    rate: float  # mean session starts per second (over a whole period)
    duration_s: float
    period_s: float = 86_400.0
    diurnal_amplitude: float = 0.0  # 0..1: the rate swings between (1 - a) and (1 + a) times the mean
    phase: float = -math.pi / 2  # start at the trough
    bursts_per_period: float = 0.0
    burst_factor: float = 3.0
    burst_s: float = 120.0
    bursts: list[tuple[float, float]] = field(default_factory=list)  # filled by ``plan_bursts``

    def __post_init__(self) -> None:
        if not self.rate > 0 or not self.duration_s > 0 or not self.period_s > 0:
            raise ValueError("rate, duration_s and period_s must be > 0")
        if not 0 <= self.diurnal_amplitude < 1:
            raise ValueError("diurnal_amplitude must be in [0, 1)")

    def plan_bursts(self, rng: random.Random) -> None:
        n = int(round(self.bursts_per_period * self.duration_s / self.period_s))
        starts = sorted(rng.uniform(0, max(self.duration_s - self.burst_s, 0.0)) for _ in range(n))
        self.bursts = [(s, s + self.burst_s) for s in starts]

    def rate_at(self, t: float) -> float:
        r = self.rate * (1 + self.diurnal_amplitude * math.sin(2 * math.pi * t / self.period_s + self.phase))
        for start, end in self.bursts:
            if start <= t < end:
                r *= self.burst_factor
                break
        return r

    def peak_rate(self) -> float:
        return self.rate * (1 + self.diurnal_amplitude) * (self.burst_factor if self.bursts else 1.0)

    def starts(self, rng: random.Random) -> list[float]:
        """Session start times: a non-homogeneous Poisson process by thinning."""
        peak, t, out = self.peak_rate(), 0.0, []
        while True:
            t += rng.expovariate(peak)
            if t >= self.duration_s:
                return out
            if rng.random() * peak < self.rate_at(t):
                out.append(t)


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int = 1, hi: int = 1 << 30) -> int:
    return int(min(hi, max(lo, round(median * math.exp(sigma * rng.gauss(0, 1))))))


class _Zipf:
    def __init__(self, n: int, alpha: float):
        weights = [1 / (k ** alpha) for k in range(1, n + 1)]
        total = sum(weights)
        self.cdf = list(itertools.accumulate(w / total for w in weights))

    def draw(self, rng: random.Random) -> int:
        return min(bisect.bisect_left(self.cdf, rng.random()), len(self.cdf) - 1)


class BlockSpace:
    """Block hashes: shared content chains are memoised, private blocks come from a counter."""

    def __init__(self, block_size: int, seed: int):
        self.block_size = block_size
        self._chains: dict[tuple, list[int]] = {}
        self._rng = random.Random(seed ^ 0x5EED)
        self._next = 1 << 40

    def fresh(self, n: int) -> list[int]:
        start, self._next = self._next, self._next + n
        return list(range(start, start + n))

    def shared(self, parent: int, key, n: int) -> list[int]:
        """``n`` blocks of content ``key`` following the block hashed ``parent`` (0: the prompt's start)."""
        chain = self._chains.get((parent, key))
        if chain is None or len(chain) < n:
            chain = self._chains[(parent, key)] = [self._rng.getrandbits(62) | 1 for _ in range(n)]
        return chain[:n]


@dataclass
class MixSpec:
    kind: str
    share: float  # fraction of sessions
    tier: str


DEFAULT_MIX = (MixSpec("chat", 0.35, "interactive"), MixSpec("system-prompt", 0.25, "standard"),
               MixSpec("rag", 0.2, "batch"), MixSpec("agent", 0.2, "interactive"))


class WorkloadGenerator:
    def __init__(self, seed: int, block_size: int, mix=DEFAULT_MIX, max_context: int = 32_768,
                 length_scale: float = 1.0, model: str = ""):
        if abs(sum(m.share for m in mix) - 1) > 1e-6:
            raise ValueError("mix shares must add up to 1")
        unknown = [m.kind for m in mix if m.kind not in MIXES]
        if unknown:
            raise ValueError(f"unknown workload kinds {unknown}; known: {', '.join(MIXES)}")
        self.rng = random.Random(seed)
        self.blocks = BlockSpace(block_size, seed)
        self.bs = block_size
        self.mix = mix
        self.max_context = max_context
        self.scale = length_scale  # <1 shrinks every length (a small model's context), keeps the shapes
        self.model = model
        self._apps = _Zipf(100, 1.0)
        self._docs = _Zipf(10_000, 1.1)
        self._app_len = [int(self.rng.uniform(1000, 3000)) for _ in range(100)]
        self._doc_len = [_lognormal(self.rng, 5500, 0.6, 500, 24_000) for _ in range(10_000)]

    def _n(self, tokens: float) -> int:
        return max(1, int(tokens * self.scale))

    def _prompt(self, segments: list[tuple], private_tokens: int) -> tuple[list[int], int]:
        """Hashes and length of shared segments ``(key, tokens)`` then ``private_tokens`` of its own."""
        hashes: list[int] = []
        tokens = 0
        for key, n in segments:
            # a shared segment only shares its full blocks; whatever is left over starts the private part
            full = n // self.bs
            hashes += self.blocks.shared(hashes[-1] if hashes else 0, key, full)
            tokens += full * self.bs
            private_tokens += n - full * self.bs
        tokens += private_tokens
        hashes += self.blocks.fresh(private_tokens // self.bs)
        return hashes, tokens

    def sessions(self, shape: ArrivalShape) -> list[SimRequest]:
        with collector_paused():  # millions of lists and requests, no cycles: half the build's time was the collector's
            return self._sessions(shape)

    def _sessions(self, shape: ArrivalShape) -> list[SimRequest]:
        shape.plan_bursts(self.rng)
        out: list[SimRequest] = []
        kinds, weights = [m for m in self.mix], [m.share for m in self.mix]
        for sid, start in enumerate(shape.starts(self.rng)):
            spec = self.rng.choices(kinds, weights)[0]
            out.extend(getattr(self, "_" + spec.kind.replace("-", "_"))(sid, start, spec.tier))
        out = [r for r in out if r.arrival < shape.duration_s and r.num_tokens + r.out_tokens <= self.max_context]
        out.sort(key=lambda r: r.arrival)
        for i, r in enumerate(out):
            r.id = i
            r.model = self.model
        return out

    # ---- the four patterns -------------------------------------------------------
    def _chat(self, sid: int, t: float, tier: str) -> list[SimRequest]:
        rng, system = self.rng, ("chat-sys", self.rng.randrange(20))
        segments = [(system, self._n(400))]
        turns = 1 + int(rng.expovariate(1 / 3))  # mean 4 turns
        out = []
        for turn in range(turns):
            user = self._n(_lognormal(rng, 150, 1.0, 4, 4000))
            answer = self._n(_lognormal(rng, 129, 0.8, 4, 1024))
            hashes, tokens = self._prompt(segments + [(("chat", sid, turn), user)], 0)
            out.append(SimRequest(0, t, tier, hashes, tokens, answer, "chat"))
            segments = segments + [(("chat", sid, turn), user + answer)]  # the next turn's history
            t += answer * 0.02 + rng.expovariate(1 / 30)  # reading and typing: ~30 s between turns
        return out

    def _system_prompt(self, sid: int, t: float, tier: str) -> list[SimRequest]:
        app = self._apps.draw(self.rng)
        hashes, tokens = self._prompt([(("app", app), self._n(self._app_len[app]))],
                                      self._n(_lognormal(self.rng, 200, 1.0, 4, 8000)))
        return [SimRequest(0, t, tier, hashes, tokens, self._n(_lognormal(self.rng, 129, 0.8, 4, 2048)),
                           "system-prompt")]

    def _rag(self, sid: int, t: float, tier: str) -> list[SimRequest]:
        doc = self._docs.draw(self.rng)
        hashes, tokens = self._prompt([(("rag-sys",), self._n(600)), (("doc", doc), self._n(self._doc_len[doc]))],
                                      self._n(_lognormal(self.rng, 60, 0.7, 4, 1000)))
        return [SimRequest(0, t, tier, hashes, tokens, self._n(_lognormal(self.rng, 150, 0.7, 4, 2048)), "rag")]

    def _agent(self, sid: int, t: float, tier: str) -> list[SimRequest]:
        rng = self.rng
        segments = [(("agent-tools",), self._n(1500)), (("repo", sid), self._n(_lognormal(rng, 1500, 0.6, 200, 8000)))]
        out = []
        for step in range(1 + int(rng.expovariate(1 / 7))):  # mean 8 steps
            tool = self._n(_lognormal(rng, 300, 1.0, 8, 6000))
            answer = self._n(_lognormal(rng, 40, 1.0, 2, 1024))
            hashes, tokens = self._prompt(segments + [(("step", sid, step), tool)], 0)
            out.append(SimRequest(0, t, tier, hashes, tokens, answer, "agent"))
            segments = segments + [(("step", sid, step), tool + answer)]
            t += answer * 0.02 + rng.uniform(1.0, 5.0)  # the tool runs for a few seconds
        return out


def routing_bench_workload(seed: int, block_size: int, requests: int = 200, prompts: int = 8,
                           prompt_tokens: int = 1024) -> list[SimRequest]:
    """``pdserve bench routing``'s workload: ``prompts`` system prompts of ``prompt_tokens`` tokens and
    ``requests`` requests, each one of them plus its own 16-32-token suffix, 8 output tokens; sent
    closed-loop (arrival times are filled in by the simulator). As the bench (``router/bench.py``
    ``make_workload``), every prompt is used equally often, in a seeded shuffled order."""
    rng = random.Random(seed)
    space = BlockSpace(block_size, seed)
    order = [i % prompts for i in range(requests)]
    rng.shuffle(order)
    out = []
    for i, system in enumerate(order):
        suffix = rng.randint(16, 32)
        shared = space.shared(0, ("system", system), prompt_tokens // block_size)
        tokens = prompt_tokens + suffix
        hashes = shared + space.fresh(tokens // block_size - len(shared))
        out.append(SimRequest(i, 0.0, "standard", hashes, tokens, 8, "routing-bench"))
    return out
