"""The live planner's inputs, read where the services publish them.

* Redis: the worker registry (``pd:workers``: each worker's role, model, KV blocks in
  use, running sequences, queued prefill tokens, draining) and the admission queue's
  hash ``pd:{q}:admission`` (prompt tokens waiting per tier).
* Prometheus metrics: every registered worker's ``/metrics`` (its ``metrics_address``)
  and any extra endpoints named (the router's, for its per-request TTFT). Counters and
  histograms are read as deltas between two reads, so one read is one window:
  computed prompt tokens = (``pdserve_prefix_cache_queries_total`` -
  ``pdserve_prefix_cache_hits_total``) x block size; TTFT attainment from
  ``pdserve_ttft_seconds{role="router"}`` (or the prefill role's when no router is
  scraped); ITL attainment from ``pdserve_inter_token_latency_seconds{role="decode"}``
  (per token gap: the share of gaps within the SLO). An attainment is read at the
  largest histogram bucket not above the SLO, so choose SLOs on bucket bounds.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from services.planner.policy import Signals
from services.queue.admission import AdmissionQueue
from services.registry import WorkerInfo, read_workers

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0


def scrape(address: str) -> dict[tuple, float]:
    """``{(sample name, sorted labels): value}`` from one ``/metrics`` endpoint (host:port or URL)."""
    url = address if address.startswith("http") else f"http://{address}/metrics"
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as reply:
        text = reply.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _sum(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def attainment(before: dict, after: dict, histogram: str, role: str, slo_s: float) -> tuple[float | None, int]:
    """The share of the window's observations within ``slo_s`` (None when there were none), and their count."""
    count = _sum(after, f"{histogram}_count", role=role) - _sum(before, f"{histogram}_count", role=role)
    if count <= 0:
        return None, 0
    bounds = sorted({(float(dict(ls)["le"]), dict(ls)["le"]) for (n, ls) in after
                     if n == f"{histogram}_bucket" and dict(ls).get("role") == role and dict(ls)["le"] != "+Inf"})
    within = [label for bound, label in bounds if bound <= slo_s]
    if not within:
        return 0.0, int(count)
    le = within[-1]
    good = (_sum(after, f"{histogram}_bucket", role=role, le=le)
            - _sum(before, f"{histogram}_bucket", role=role, le=le))
    return good / count, int(count)


@dataclass
class Snapshot:
    signals: Signals
    workers: list[WorkerInfo]
    unreachable: list[str] = field(default_factory=list)  # metrics endpoints that did not answer


class SignalReader:
    """One ``read()`` per planner tick; counters are differenced against the previous read."""

    def __init__(self, redis, model: str | None = None, ttft_slo_s: float = 2.5, itl_slo_s: float = 0.1,
                 extra_metrics: list[str] | None = None, clock=time.monotonic):
        self.redis = redis
        self.model = model
        self.ttft_slo_s = ttft_slo_s
        self.itl_slo_s = itl_slo_s
        self.extra = list(extra_metrics or [])
        self.clock = clock
        self.admission = AdmissionQueue(redis)
        self._before: dict[str, dict] = {}
        self._at: float | None = None

    async def read(self) -> Snapshot:
        now = self.clock()
        workers = [w for w in await read_workers(self.redis) if self.model is None or w.model == self.model]
        depth = await self.admission.depth()
        endpoints = [w.metrics_address for w in workers if w.metrics_address] + self.extra
        scraped = await asyncio.gather(*(asyncio.to_thread(scrape, e) for e in endpoints), return_exceptions=True)
        after, unreachable = {}, []
        for endpoint, result in zip(endpoints, scraped):
            if isinstance(result, BaseException):
                unreachable.append(endpoint)
                log.warning("cannot scrape %s: %s", endpoint, result)
            else:
                after[endpoint] = result
        window_s = now - self._at if self._at is not None else 0.0
        computed = ttft_n = itl_n = 0.0
        ttft_good = itl_good = 0.0
        block = {w.metrics_address: w.block_size for w in workers}
        ttft_role = "router" if any(_sum(s, "pdserve_ttft_seconds_count", role="router") for s in after.values()) \
            else "prefill"
        for endpoint, samples in after.items():
            before = self._before.get(endpoint)
            if before is None:  # first sight of this endpoint: its counters start the window
                continue
            blocks = (_sum(samples, "pdserve_prefix_cache_queries_total")
                      - _sum(before, "pdserve_prefix_cache_queries_total")
                      - _sum(samples, "pdserve_prefix_cache_hits_total")
                      + _sum(before, "pdserve_prefix_cache_hits_total"))
            computed += max(blocks, 0) * block.get(endpoint, 16)
            share, n = attainment(before, samples, "pdserve_ttft_seconds", ttft_role, self.ttft_slo_s)
            ttft_good, ttft_n = ttft_good + (share or 0) * n, ttft_n + n
            share, n = attainment(before, samples, "pdserve_inter_token_latency_seconds", "decode", self.itl_slo_s)
            itl_good, itl_n = itl_good + (share or 0) * n, itl_n + n
        self._before, self._at = after, now
        active = [w for w in workers if not w.draining]
        decode = [w for w in active if w.role == "decode"]
        prefill = [w for w in active if w.role == "prefill"]
        signals = Signals(
            now=now, prefill_workers=len(prefill), decode_workers=len(decode),
            prefill_tokens_per_s=computed / window_s if window_s > 0 else 0.0,
            queued_prefill_tokens=depth.prompt_tokens + sum(w.queued_prefill_tokens for w in prefill),
            kv_blocks_used=sum(w.kv_blocks_used for w in decode),
            running_seqs=sum(w.num_running + w.num_waiting for w in decode),
            ttft_attainment=ttft_good / ttft_n if ttft_n else None,
            itl_attainment=itl_good / itl_n if itl_n else None,
            requests_in_window=int(ttft_n) + depth.requests + sum(w.num_running for w in active),
            judged_requests=int(ttft_n))
        return Snapshot(signals, workers, unreachable)
