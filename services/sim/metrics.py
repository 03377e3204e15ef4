"""What a run gives: hit rate, TTFT and inter-token latency percentiles, goodput, utilisation.

Definitions (each request counted once it finished):

* hit rate: prompt tokens served from a prefill worker's prefix cache / prompt tokens;
* TTFT: arrival (queueing included) to the first token;
* ITL: a request's mean gap between output tokens after the first
  ((finish - first token) / (output tokens - 1)); requests with one output token have none;
* goodput: requests per second that met both the TTFT and the ITL SLO (the SLOs are
  per run; DistServe's definition, Zhong et al., OSDI 2024);
* utilisation: each worker's compute seconds / its registered seconds, averaged per role.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.bench.stats import percentile


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    itl_s: float

    def __post_init__(self) -> None:
        if not self.ttft_s > 0 or not self.itl_s > 0:
            raise ValueError("SLO thresholds must be > 0")

    def met(self, job) -> bool:
        return ttft(job) <= self.ttft_s and itl(job) <= self.itl_s


def ttft(job) -> float:
    return job.first_token_at - job.req.arrival


def itl(job) -> float:
    n = job.req.out_tokens
    return (job.finished_at - job.first_token_at) / (n - 1) if n > 1 else 0.0


def summarize(sim, slo: SLO, warmup_s: float = 0.0) -> dict:
    """The run's figures; requests arriving before ``warmup_s`` are left out (cold caches)."""
    done = [j for j in sim.jobs if j.finished_at >= 0 and j.req.arrival >= warmup_s]
    if not done:
        return {"requests": 0}
    prompt = sum(j.req.num_tokens for j in done)
    cached = sum(j.cached_tokens for j in done)
    ttfts = [ttft(j) for j in done]
    itls = [itl(j) for j in done if j.req.out_tokens > 1]
    start = min(j.req.arrival for j in done)
    end = max(j.finished_at for j in done)
    span = max(end - start, 1e-9)
    good = sum(1 for j in done if slo.met(j))
    util = {}
    for role in ("prefill", "decode"):
        workers = [w for w in list(sim.workers.values()) + sim.retired if w.role == role]
        lived = sum(max(getattr(w, "retired_at", sim.loop.now) - w.ready_at, 1e-9) for w in workers)
        util[role] = round(sum(w.busy_s for w in workers) / lived, 4) if workers else None
    return {
        "requests": len(done),
        "duration_s": round(span, 3),
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "ttft_s": {q: round(percentile(ttfts, p), 4) for q, p in (("p50", 50), ("p90", 90), ("p99", 99))}
        | {"mean": round(sum(ttfts) / len(ttfts), 4)},
        "itl_s": {q: round(percentile(itls, p), 5) for q, p in (("p50", 50), ("p90", 90), ("p99", 99))},
        "slo_attainment": round(good / len(done), 4),
        "goodput_rps": round(good / span, 3),
        "throughput_rps": round(len(done) / span, 3),
        "local_prefill_share": round(sum(j.local for j in done) / len(done), 4),
        "utilisation": util,
        "peak_queued": max((s["queued"] for s in sim.series), default=0),
    }
