"""How many prefill and decode workers to run, and how many to keep warm.

Inputs (``Signals``, one snapshot per tick; the live service reads them from Redis
and Prometheus, the simulator from its cluster):

* prefill demand: prompt tokens computed per second over the last window, plus the
  queue's lag (tokens queued ahead of the prefill workers, in seconds of their work);
* decode demand: KV blocks in use and running sequences;
* SLO attainment over the last window (TTFT and ITL).

Rule, per role::

    need = ceil(demand / (per-worker capacity * target_utilisation))
    or, with staffing_beta > 0 (square-root staffing): need = ceil(a + staffing_beta * sqrt(a)), a = demand /
    per-worker capacity (the offered load in workers); decode's KV the same with kv_staffing_beta
    prefill: + ceil(lag_s / lag_target_s) workers while the queue lags (clears the backlog)
    attainment under slo_target: need *= boost (the estimate is missing something: add headroom)
    demand: the trimmed mean of the windows over the last trend_window_s (less the highest and
    the lowest), not the last window's (noisy: prompts are counted as they finish)
    lookahead_s > 0: demand is read ahead by its rising trend (the least-squares slope over the
    last trend_window_s less twice its standard error) times lookahead_s, so workers ordered now
    are ready when the demand is (set it to the cold start: a worker started now serves
    lookahead_s from now)

Prefill demand under ``local_prefill_below`` of one prefill worker runs no prefill worker: the decode
workers prefill it (the router does when none is registered). Scale up at once; scale down only after
``need`` stayed below the current count for ``down_after_s`` (hysteresis), by at most ``down_step`` of it
per tick and at most once per ``down_every_s``. A boost on missed SLOs waits for misses still happening
(the queue lagging, or the last window under the target) with ``boost_only_while_missing``. A warm pool of standby workers (model loaded, not registered) hides cold starts: the next
scale-up takes them first (a warm start of seconds instead of minutes). It holds what the demand would
need beyond the decided workers, served at ``burst_utilisation``, in a burst (the last window's demand x
``burst_factor``) or a cold start (``lookahead_s``) up the trend's fitted slope, whichever is more; at
least ``warm_min`` (1) and ``warm_fraction`` of the active workers. With no traffic for
``idle_to_zero_s`` a model scales to zero active workers and keeps ``warm_min`` warm.

``ThresholdRule`` is the baseline: an HPA on utilisation (desired = ceil(current *
utilisation / target)), with HPA's default 300 s scale-down stabilisation and no warm pool.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from services.planner.forecast import DemandForecast


@dataclass(frozen=True)
class Capacity:
    """One worker's capacity, from its profile (the simulator) or flags (the live service)."""

    prefill_tokens_per_s: float
    kv_blocks: int
    max_num_seqs: int

    def __post_init__(self) -> None:
        if not self.prefill_tokens_per_s > 0 or self.kv_blocks < 1 or self.max_num_seqs < 1:
            raise ValueError("capacities must be > 0")


@dataclass
class Signals:
    now: float
    prefill_workers: int
    decode_workers: int
    prefill_tokens_per_s: float  # computed (uncached) prompt tokens per second, last window
    queued_prefill_tokens: float  # waiting in the admission queue and on prefill workers
    kv_blocks_used: int
    running_seqs: int
    ttft_attainment: float | None = None  # fraction of the window's requests within the TTFT SLO
    itl_attainment: float | None = None
    requests_in_window: int = 0
    judged_requests: int = 0  # the requests the attainments are over (0: requests_in_window)
    # of prefill_workers / decode_workers, those ordered and still starting (not yet serving); the live
    # reader counts registered workers only and leaves these 0
    prefill_starting: int = 0
    decode_starting: int = 0


@dataclass(frozen=True)
class Decision:
    prefill: int
    decode: int
    warm: int  # standby workers to keep (model loaded, not registered), both roles together
    reason: str = ""


@dataclass
class PlannerConfig:
    target_utilisation: float = 0.6
    kv_target: float = 0.7
    lag_target_s: float = 1.0
    slo_target: float = 0.99
    slo_min_requests: int = 20  # fewer in the SLO window: its attainment is noise (one slow request of 5 is 80%)
    # the SLO is judged over the requests of the last slo_window_s, and missed when their misses exceed what
    # slo_target allows by slo_sigmas binomial standard deviations: judged per 10 s window against 0.99, a
    # window of 50 requests at a true 0.995 misses one 22% of the time, and the boosts that noise ordered ran
    # the day's peak at 1.8x the prefill workers its demand needed (k = 12, coding seed 1)
    slo_window_s: float = 120.0
    slo_sigmas: float = 2.0
    boost: float = 1.25
    boost_every_s: float = 30.0  # at most one boost per role this often
    # boost the prefill only while TTFTs are still missed: the queue lags or the last window missed the SLO.
    # The SLO window's misses outlive the backlog that made them, and a boost on them once the backlog was
    # cleared ran 29 prefill workers up to 37, whose scale-down then dropped the cache of 20 at once
    boost_only_while_missing: bool = False
    # 150 s of a real day, a little over one cold start (120 s on the h100 profile): at 300 the hysteresis held
    # what the queue lag ordered at target 0.8, but at target 0.6 the lag orders almost nothing and the hold
    # was the planner's largest overspend (2.47 prefill + 1.42 decode of 36.4 worker-h at 32 starts/s; k = 12,
    # coding seed 1). 150: rate 8 0.922x -> 0.895x static (seed 0: 0.917x -> 0.897x); rate 32 36.436 -> 36.104
    # worker-h at 0.9991 attainment (BENCHMARKS.md, sixteenth session)
    down_after_s: float = 150.0
    down_step: float = 0.25
    # at most one scale-down per role this often (0: every tick). A drained worker's prefix cache goes with it,
    # and its prompts are computed again elsewhere: the day's TTFT misses came after scale-downs, when that
    # surge met the fewer workers
    down_every_s: float = 0.0
    # a scale-down goes to this quantile of the needs of the last down_after_s (1: their highest). The highest
    # is the noise's peak: at target 0.6 the day's peak ran 9.3 prefill workers where its mean demand needed
    # 4.5 (k = 12, coding seed 1)
    down_floor_quantile: float = 1.0
    # the warm pool covers the jump in demand the SLO must survive for a cold start: demand x
    # burst_factor served at burst_utilisation needs this many more workers than are running
    burst_factor: float = 1.5
    burst_utilisation: float = 0.9
    # decode's KV in that burst is held to this share of the workers' blocks (0: burst_utilisation). KV is a
    # hard limit: at 0.9 on average some workers are full, and a first token waits for room. 0.7: with 0.9 the
    # rate-32 day's second burst met the SLO for 0.8989 of its requests (the day 0.9991); 0.7 served both bursts
    # at 1.0 for 3% more worker-hours (BENCHMARKS.md, "Autoscaling, nineteenth session")
    burst_kv_target: float = 0.7
    warm_fraction: float = 0.0  # and at least this share of the active workers
    # the pool grows only for a need that held this long: the lowest pool decided over the last warm_confirm_s
    # (it shrinks at once). The burst part is sized on the last window's demand, whose noise raised the pool
    # for a tick or two, long enough to start standbys loading and not to finish one: their loads were
    # cancelled at the next tick (0: no confirmation)
    warm_confirm_s: float = 0.0
    # how the pool is acted on (the simulator's actuator; on Kubernetes, the standby deployment's scale-down
    # delay): a drained worker parks in the pool even when it is full, and a loaded standby the pool does not
    # need is let go only once the pool stood over its target this long. 0: a drained worker parks only in a
    # short pool, and a surplus goes at once. The day's counts went up and down by one every few ticks around
    # their noise, and each time a worker was drained and let go, and the standby the next scale-up took was
    # loaded again cold
    standby_hold_s: float = 0.0
    # a fixed standby: 0 (the pool from the burst and the rise alone) cost attainment on the day (k = 12, coding
    # seed 1: 0.9717 against 0.9909): the pool those two size is ~0 when the decided counts already stand over
    # the demand, and each ramp's first scale-up then starts cold
    warm_min: int = 1
    # with a forecast: keep the warm_min standbys only while the forecast's mean demand over the next this many
    # seconds stands over its mean over the last as many (a rising day; 0: always). On the way down the workers
    # the hysteresis holds over the demand cover a jump, and the standby is seldom taken
    warm_min_ahead_s: float = 0.0
    idle_to_zero_s: float = 900.0
    # no prefill worker while the prefill demand is under this share of one (at the target utilisation): the
    # decode workers prefill it themselves (the router prefills on the decode worker when no prefill worker
    # is registered). Off (0) by default: the decode worker's own prefills stall its steps (~76 ms for 2k
    # tokens on the h100 profile against a 50 ms ITL SLO), and at 0.5 the day's ITL misses ordered more decode
    # workers than the prefill worker saved (k = 12, coding seed 1: 1.072x static at 0.993, 1.035x without)
    local_prefill_below: float = 0.0
    # square-root staffing (Halfin and Whitt, Operations Research 1981): a pool of n servers offered a workers
    # of load waits about as often at every size when n = a + beta * sqrt(a), so the utilisation it runs at
    # rises with the load (a fixed target pays the same headroom share at 20 workers as at 2). 0: the fixed
    # target_utilisation. Prefill's a: computed prompt tokens/s over one worker's; kv_staffing_beta: decode's
    # KV blocks in use over one worker's (0: the fixed kv_target)
    staffing_beta: float = 0.0
    kv_staffing_beta: float = 0.0
    # a deadband on the way up, in workers: the demand's count rises past the workers running only once its
    # need (in fractional workers) stands over them by this much (0: at once). The need hovers at an integer
    # now and then for minutes, and each crossing upward started a worker the hysteresis then held for
    # down_after_s and the pool refilled cold. The queue's lag and the SLO's boosts are not held back by it
    up_margin: float = 0.0
    # decode's running and waiting sequences are held to this share of max_num_seqs (0: target_utilisation).
    # A decode step's time hardly moves with the batch (h100-measured: 31 ms at 100 sequences, 33 at 256 with
    # full KV, against a 50 ms ITL SLO), so the slots are a hard limit like the KV blocks, not a queue whose
    # waits grow with the utilisation
    seq_target: float = 0.0
    # the trend test's standard error from the windows' lag-1 autocorrelation (False: as if independent). At
    # the day's peak decode's KV need swung 4.0-8.9 workers with an autocorrelation of 0.59 in a trend window,
    # and decode ran 7.85 workers where its level needed 6.27. With this on it still ran 7.87 (the level's own
    # swings, held by the hysteresis), and prefill, its lookahead lost on the real ramp, missed more TTFTs: over
    # the day's first 3,300 s 0.9946 against 0.9987 (BENCHMARKS.md, "Autoscaling, twenty-third session")
    trend_autocorrelation: bool = False
    # decode's KV blocks and sequences read at least the lower of the last two windows, not the trend window's
    # trimmed mean alone (False). Blocks held are held now: the mean of a 300 s window lagged a burst's KV by
    # half of it, and on the rate-32 day at a 33.5 s cold start a scale-down from 6 to 5 decode workers decided
    # on that mean 0.9 s (simulated) into burst 2 left 130k blocks on 5 workers (94% full), whose first tokens
    # then waited for room: the burst met the SLO for 0.8714 of its requests (BENCHMARKS.md, "Autoscaling,
    # thirtieth session"). Off: on the bench's day with the other defaults it failed burst 2 (0.9753; decode
    # ordered 3 more workers in the burst, from the standbys prefill uses too; "thirty-second session")
    held_level_recent: bool = False
    # a role scales down only once the lower of the last two windows' demand needs fewer workers than run, too
    # (False: the trimmed mean's need alone). The trimmed mean of a trend window lags a burst by half of it:
    # on the rate-64 day without a standby (k = 12, coding seed 1) prefill went from 18 workers to 16 inside
    # burst 2 while its windows computed 360-630k prompt tokens/s and the queue grew to 1.5M tokens, and the
    # burst met the SLO for 0.981 of its requests. With it, no standby and prefill target 0.7 met it in both bursts
    # at 0.592 of static's minimum; at target 0.65 burst 2 was still lost (BENCHMARKS.md, "thirty-fifth session")
    down_hold_recent: bool = False
    lookahead_s: float = 0.0  # 0: react to the demand now; else read it this far ahead on its rising trend
    # with a forecast: the level is the forecast's demand now, scaled by the demand seen over this long a window
    # against the forecast's for it (0: the trend window's trimmed mean). The trimmed mean of a trend window's
    # noisy windows swings by a worker or two at the day's peak, the hysteresis holds each swing up, and each
    # one started a worker; a long window's ratio to the forecast hardly swings, and the forecast carries the
    # day's shape within it. A step (a burst) is still taken at once, as from the trimmed mean
    forecast_level_s: float = 0.0
    # 300 s of a real day: at 120 the demand's level was noisy enough that the hysteresis floor (the highest need
    # of its window) ran the day's peak at twice the mean's need (k = 12, coding seed 1, target 0.6: 1.071x static
    # at 120, 0.922x at 300; target 0.8: 0.997x -> 0.935x; benchmarks/probes/planner_config_probe.py)
    trend_window_s: float = 300.0
    min_prefill: int = 0
    min_decode: int = 1
    max_workers: int = 10_000

    def __post_init__(self) -> None:
        if not 0 <= self.burst_kv_target <= 1:
            raise ValueError("burst_kv_target must be in [0, 1] (0: burst_utilisation)")
        for name in ("target_utilisation", "kv_target", "slo_target", "down_step", "burst_utilisation",
                     "down_floor_quantile"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1]")
        if self.burst_factor < 1:
            raise ValueError("burst_factor must be >= 1 (1: no burst to survive)")
        if self.boost < 1 or self.lag_target_s <= 0 or self.down_after_s < 0 or self.idle_to_zero_s <= 0:
            raise ValueError("boost >= 1, lag_target_s > 0, down_after_s >= 0 and idle_to_zero_s > 0 needed")
        if not 0 <= self.local_prefill_below <= 1:
            raise ValueError("local_prefill_below must be in [0, 1]")
        if not self.slo_window_s > 0 or self.slo_sigmas < 0:
            raise ValueError("slo_window_s > 0 and slo_sigmas >= 0 needed")
        if self.down_every_s < 0:
            raise ValueError("down_every_s must be >= 0")
        if not (self.staffing_beta >= 0 and self.kv_staffing_beta >= 0):
            raise ValueError("staffing_beta and kv_staffing_beta must be >= 0 (0: the fixed targets)")
        if self.warm_confirm_s < 0 or self.standby_hold_s < 0 or self.warm_min_ahead_s < 0:
            raise ValueError("warm_confirm_s, standby_hold_s and warm_min_ahead_s must be >= 0")
        if not 0 <= self.seq_target <= 1:
            raise ValueError("seq_target must be in [0, 1] (0: target_utilisation)")
        if not 0 <= self.up_margin < 1:
            raise ValueError("up_margin must be in [0, 1) workers (0: scale up at once)")
        if self.lookahead_s < 0 or not self.trend_window_s > 0 or self.forecast_level_s < 0:
            raise ValueError("lookahead_s >= 0, trend_window_s > 0 and forecast_level_s >= 0 needed")
        if min(self.warm_min, self.min_prefill, self.min_decode) < 0 or self.warm_fraction < 0:
            raise ValueError("minimums and warm_fraction must be >= 0")


@dataclass
class Planner:
    config: PlannerConfig
    capacity: Capacity
    # the demand by time of day from earlier days (forecast.py): read ahead instead of the trend
    forecast: DemandForecast | None = None
    _below_since: dict = field(default_factory=dict)
    _last_traffic: float | None = None  # idle is counted from the first decision
    _history: deque = field(default_factory=deque)  # (now, prefill tokens/s, KV blocks, sequences) for the trend
    _seen: deque = field(default_factory=deque)  # the same over the last forecast_level_s
    _boosted_at: dict = field(default_factory=dict)
    _down_at: dict = field(default_factory=dict)  # per role: when it last scaled down
    _needs: dict = field(default_factory=dict)  # per role: (now, need) over the last down_after_s
    _slo: dict = field(default_factory=dict)  # per SLO: (now, requests, misses) over the last slo_window_s
    _warm: deque = field(default_factory=deque)  # (now, pool) over the last warm_confirm_s
    _recent: tuple = ()  # per signal, the lower of the last two windows (down_hold_recent)

    def _ahead(self, s: Signals) -> tuple[tuple, tuple, tuple]:
        """The demand now (the window's trimmed mean); that plus its rise to now and over ``lookahead_s``
        when the least-squares slope over ``trend_window_s`` rises by more than its noise (the cold orders);
        and that plus the fitted slope's rise (the warm pool). All three raw while the history is short."""
        now = (s.prefill_tokens_per_s, float(s.kv_blocks_used), float(s.running_seqs))
        c = self.config
        self._history.append((s.now, *now))
        while self._history[0][0] < s.now - c.trend_window_s:
            self._history.popleft()
        scaled = self._forecast_level(s.now, now)  # (level, ahead) per signal, or None
        last = (self._history[-2], self._history[-1]) if len(self._history) > 1 else (self._history[-1],)
        self._recent = tuple(min(h[i] for h in last) for i in range(1, len(now) + 1))  # a step's, and the holds'
        span = s.now - self._history[0][0]
        if span < c.trend_window_s / 2 or len(self._history) < 4:  # one window's noise is not a trend
            return now, now, now
        # not the last window alone: a window's demand is noisy (+-60% at 0.2 s windows; prompts are counted
        # as they finish, in clumps), and the hysteresis holds what the noise orders. The level is the mean of
        # the trend window's windows less its highest and lowest (one window's spike is not a step). A median
        # of the last three windows was tried: the scale-down floor (the highest need of the hysteresis
        # window) is then a high quantile of three-window noise, and at k = 12 the planner ran 30 prefill
        # workers where the day's peak needed ~12 (tests/sim/test_planner.py, a stationary noisy demand).
        # The least-squares slope counts only beyond twice its standard error: noise times a cold start is
        # not a trend
        ts = [h[0] for h in self._history]
        n = len(ts)
        mean_t = sum(ts) / n
        var = sum((t - mean_t) ** 2 for t in ts)
        levels, ahead, likely = [], [], []
        for i in range(1, len(now) + 1):
            ys = [h[i] for h in self._history]
            mean_y = sum(ys) / n
            slope = sum((t - mean_t) * (y - mean_y) for t, y in zip(ts, ys)) / var
            residual = sum((y - mean_y - slope * (t - mean_t)) ** 2 for t, y in zip(ts, ys))
            # the slope's lower bound (less twice its standard error): a noise slope read a cold start ahead
            # ordered twice the workers now and then, and the hysteresis held them
            noise = math.sqrt(residual / (n - 2))  # one window's scatter about the line
            se = noise / math.sqrt(var)
            if c.trend_autocorrelation and residual > 0:
                # the windows are not independent: a slow swing is many windows high in a row. With a lag-1
                # autocorrelation rho the line has about n (1 - rho) / (1 + rho) independent windows
                r = [y - mean_y - slope * (t - mean_t) for t, y in zip(ts, ys)]
                rho = min(0.95, max(0.0, lag1_autocorrelation(r)))
                se *= math.sqrt((1 + rho) / (1 - rho))
            rise = max(0.0, slope - 2 * se)
            level = (sum(ys) - max(ys) - min(ys)) / (n - 2)
            # a step (the last two windows both above the level by three times the scatter of the windows
            # before them) is taken at once: the window's mean would take half a trend window to see it. One
            # high window, or a median of three, is noise often enough for the hysteresis to hold it
            before = ys[:-2]
            recent = self._recent[i - 1]
            step = len(before) >= 2 and recent > level + 3 * statistics.stdev(before)
            if scaled is not None and scaled[i - 1] is not None:
                level = max(scaled[i - 1][0], recent) if step else scaled[i - 1][0]
            elif step:
                level = recent
            if c.held_level_recent and i > 1:  # KV blocks, sequences: a level held, not a rate counted
                level = max(level, recent)
            levels.append(level)
            ahead.append(max(0.0, level + rise * (s.now - mean_t + c.lookahead_s)))
            likely.append(max(0.0, level + max(0.0, slope) * (s.now - mean_t + c.lookahead_s)))
        if self.forecast is not None:
            ahead = likely = self._forecast_ahead(s.now, ts[0], levels) or ahead
        if scaled is not None:
            ahead = likely = [a if x is None else max(level, x[1]) for level, a, x in zip(levels, ahead, scaled)]
        return tuple(levels), tuple(ahead), tuple(likely)

    def _forecast_level(self, now: float, demand: tuple) -> list[tuple[float, float]] | None:
        """With ``forecast_level_s``: per signal, the forecast's demand now and its highest over the next
        ``lookahead_s``, both times the demand seen over the last ``forecast_level_s`` over the forecast's
        for it (None for a signal it expects none of). None without a forecast, before half the window was
        seen, or where it has no day recorded."""
        c, f = self.config, self.forecast
        if f is None or not c.forecast_level_s:
            return None
        seen = self._seen
        seen.append((now, *demand))
        while seen[0][0] < now - c.forecast_level_s:
            seen.popleft()
        if now - seen[0][0] < c.forecast_level_s / 2:
            return None
        expected = f.expected(seen[0][0], now)
        current, coming = f.expected(now - f.bin_s, now + f.bin_s), f.peak(now, now + c.lookahead_s)
        if expected is None or current is None or coming is None:
            return None
        out = []
        for i in range(3):  # a signal the forecast expects none of keeps the trimmed mean
            ratio = sum(h[i + 1] for h in seen) / len(seen) / expected[i] if expected[i] > 0 else None
            out.append(None if ratio is None else (current[i] * ratio, coming[i] * ratio))
        return out

    def _forecast_ahead(self, now: float, since: float, levels: list[float]) -> list[float] | None:
        """The forecast's highest demand over the next ``lookahead_s``, scaled per signal by the demand seen
        over the trend window against the forecast's for it; never under the level. None where the forecast
        has no day recorded for those times."""
        f = self.forecast
        seen, coming = f.expected(since, now), f.peak(now, now + self.config.lookahead_s)
        if seen is None or coming is None:
            return None
        return [max(level, c * level / e) if e > 0 else level for level, e, c in zip(levels, seen, coming)]

    def decide(self, s: Signals) -> Decision:
        c, cap = self.config, self.capacity
        if self._last_traffic is None or s.requests_in_window or s.queued_prefill_tokens or s.running_seqs:
            self._last_traffic = s.now
        if s.now - self._last_traffic >= c.idle_to_zero_s:
            self._below_since.clear()
            self._needs.clear()
            self._history.clear()
            self._seen.clear()
            return Decision(0, 0, c.warm_min, "idle: scaled to zero")

        def counts(tokens_per_s, kv_blocks, seqs, utilisation=c.target_utilisation, kv_target=c.kv_target,
                   staffed=False, running=None, seq_target=None):
            """Workers per role for a demand: at the given targets, or (``staffed``: the decided counts) by
            square-root staffing for a role whose beta is set (a + beta x sqrt(a), a the load in workers).
            ``running``: the (prefill, decode) workers active; a role's count rises over them only once its need
            stands ``up_margin`` over them."""
            need = tokens_per_s / (cap.prefill_tokens_per_s * utilisation)
            kv = kv_blocks / (cap.kv_blocks * kv_target)
            if staffed and c.staffing_beta:
                load = tokens_per_s / cap.prefill_tokens_per_s
                prefill = load + c.staffing_beta * math.sqrt(load)
            else:
                prefill = need
            if staffed and c.kv_staffing_beta:
                kv_load = kv_blocks / cap.kv_blocks
                kv = kv_load + c.kv_staffing_beta * math.sqrt(kv_load)
            decode = max(kv, seqs / (cap.max_num_seqs * (seq_target or c.seq_target or utilisation)))
            if running is not None:
                prefill, decode = (_up(prefill, running[0], c.up_margin), _up(decode, running[1], c.up_margin))
            # under local_prefill_below of one worker at the target: the decode workers prefill it
            return 0 if need < c.local_prefill_below else math.ceil(prefill), math.ceil(decode)

        level, ahead, likely = self._ahead(s)
        running = (s.prefill_workers, s.decode_workers)
        prefill, decode = counts(*ahead, staffed=True, running=running)
        reasons = []
        if (prefill, decode) != counts(*level, staffed=True, running=running):
            reasons.append("rising demand")
        ready = max(s.prefill_workers - s.prefill_starting, 0)
        lag_s = s.queued_prefill_tokens / (cap.prefill_tokens_per_s * max(ready, 1))
        if lag_s > c.lag_target_s:
            # workers to clear the backlog by the time they serve: lag_target_s ahead, or lookahead_s
            # (a cold start) when set; more would arrive after it is gone and idle out the hysteresis.
            # Those already starting count: they were ordered for this backlog, and ordering them again
            # on every tick of their cold start was the runaway (a burst once ordered 30 workers)
            drain_s = max(c.lag_target_s, c.lookahead_s)
            backlog = math.ceil(s.queued_prefill_tokens / (cap.prefill_tokens_per_s * drain_s))
            prefill = max(prefill, ready + max(backlog, s.prefill_starting))
            reasons.append(f"queue lag {lag_s:.1f} s")
        ttft_missed = self._missed("ttft", s, s.ttft_attainment)
        itl_missed = self._missed("itl", s, s.itl_attainment)
        if ttft_missed and c.boost_only_while_missing and lag_s <= c.lag_target_s and (
                s.ttft_attainment is None or s.ttft_attainment >= c.slo_target):
            ttft_missed = None  # the misses are behind: the queue is short and the last window met the SLO
        if ttft_missed:
            prefill = max(prefill, self._boost("prefill", s.now, s.prefill_workers, s.prefill_starting, "ttft"))
            reasons.append(f"TTFT attainment {ttft_missed:.3f}")
            # a first token also waits for KV room on a decode worker: with their KV at target, the
            # missed TTFTs are theirs too
            if s.kv_blocks_used >= cap.kv_blocks * c.kv_target * max(s.decode_workers, 1):
                decode = max(decode, self._boost("decode", s.now, s.decode_workers, s.decode_starting))
                reasons.append("KV at target")
        if itl_missed:
            decode = max(decode, self._boost("decode", s.now, s.decode_workers, s.decode_starting, "itl"))
            reasons.append(f"ITL attainment {itl_missed:.3f}")
        if c.down_hold_recent:  # the last two windows still need the workers running: no scale-down
            held = counts(*self._recent, staffed=True)
            prefill = max(prefill, min(held[0], s.prefill_workers))
            decode = max(decode, min(held[1], s.decode_workers))
        prefill = self._hysteresis("prefill", s.now, s.prefill_workers, max(prefill, c.min_prefill))
        decode = self._hysteresis("decode", s.now, s.decode_workers, max(decode, c.min_decode))
        prefill = min(prefill, c.max_workers)
        decode = min(decode, c.max_workers - prefill)
        # the warm pool: what a burst of burst_factor now would need beyond the workers decided, per role
        # (the target utilisation's own headroom absorbs part of it), so the burst is served in a warm
        # start while cold starts catch up. Of the last window's demand, not the smoothed one: sized on the
        # smoothed demand the pool was smaller in a burst's first windows and the day's attainment fell from
        # 0.992-0.995 to 0.983-0.992 (k = 12, 8 sessions/s) for the same worker-hours; the standbys its noise
        # starts cold cost less than that
        now_demand = (s.prefill_tokens_per_s, s.kv_blocks_used, s.running_seqs)
        burst = counts(*(d * c.burst_factor for d in now_demand), utilisation=c.burst_utilisation,
                       kv_target=c.burst_kv_target or c.burst_utilisation, seq_target=c.burst_utilisation)
        warm = max(0, burst[0] - prefill) + max(0, burst[1] - decode)
        # and the rise the trend's own slope (not its lower bound, which the cold orders follow) brings within
        # a cold start (lookahead_s), served at burst_utilisation: a ramp's next workers start warm
        rising = counts(*likely, utilisation=c.burst_utilisation, kv_target=c.burst_utilisation,
                        seq_target=c.burst_utilisation)
        warm = max(warm, max(0, rising[0] - prefill) + max(0, rising[1] - decode))
        warm = max(warm, c.warm_min if self._rising(s.now) else 0, math.ceil(c.warm_fraction * (prefill + decode)))
        return Decision(prefill, decode, self._confirmed(s.now, warm), "; ".join(reasons) or "demand")

    def _rising(self, now: float) -> bool:
        """Whether the forecast's mean prefill tokens/s or KV over the next ``warm_min_ahead_s`` stands over its
        mean over the last as many; True without the option, a forecast, or a day recorded for those times."""
        h, f = self.config.warm_min_ahead_s, self.forecast
        if not h or f is None:
            return True
        ahead, behind = f.expected(now, now + h), f.expected(now - h, now)
        return ahead is None or behind is None or ahead[0] > behind[0] or ahead[1] > behind[1]

    def _confirmed(self, now: float, warm: int) -> int:
        """The lowest pool of the last ``warm_confirm_s``: a rise is taken once it held that long."""
        pools = self._warm
        pools.append((now, warm))
        while pools[0][0] < now - self.config.warm_confirm_s:
            pools.popleft()
        return min(w for _, w in pools)

    def _missed(self, slo: str, s: Signals, attainment: float | None) -> float | None:
        """The attainment over the last ``slo_window_s`` when its misses stand over what ``slo_target``
        allows by more than ``slo_sigmas`` standard deviations (and it has ``slo_min_requests``), else None."""
        c = self.config
        window = self._slo.setdefault(slo, deque())
        if attainment is not None:
            n = s.judged_requests or s.requests_in_window
            window.append((s.now, n, (1 - attainment) * n))
        while window and window[0][0] <= s.now - c.slo_window_s:
            window.popleft()
        total, misses = sum(w[1] for w in window), sum(w[2] for w in window)
        allowed = total * (1 - c.slo_target)
        if total < c.slo_min_requests or misses <= allowed + c.slo_sigmas * math.sqrt(max(allowed, 1.0)):
            return None
        return 1 - misses / total

    def _boost(self, role: str, now: float, current: int, starting: int, slo: str = "") -> int:
        """``current * boost``, at most once per ``boost_every_s`` and never while workers of the role are
        still starting: the misses are from before they serve, and a boost on every tick of a cold start
        compounds (1.25 ** 12 in 2 min). A boost answers the ``slo`` misses before it: their window restarts."""
        if starting or now - self._boosted_at.get(role, -math.inf) < self.config.boost_every_s:
            return current
        self._boosted_at[role] = now
        self._slo.pop(slo, None)
        # at least one more: a role at 0 (the decode workers prefilling) boosted by a factor stays at 0
        return max(current + 1, math.ceil(current * self.config.boost))

    def _hysteresis(self, role: str, now: float, current: int, need: int) -> int:
        """Up at once. Down once ``need`` stayed below ``current`` for ``down_after_s``, then to the
        ``down_floor_quantile`` of the needs of the last ``down_after_s`` (1: the highest; a burst's workers
        leave one window after it, not one step a tick), by at most ``down_step`` of ``current`` per tick."""
        needs = self._needs.setdefault(role, deque())
        needs.append((now, need))
        while needs[0][0] < now - self.config.down_after_s:
            needs.popleft()
        if need >= current:
            self._below_since.pop(role, None)
            return need
        since = self._below_since.setdefault(role, now)
        if now - since < self.config.down_after_s or now - self._down_at.get(role, -math.inf) < self.config.down_every_s:
            return current
        ordered = sorted(n for _, n in needs)
        floor = ordered[max(0, math.ceil(self.config.down_floor_quantile * len(ordered)) - 1)]
        target = max(floor, need, current - max(1, math.floor(current * self.config.down_step)))
        if target < current:
            self._down_at[role] = now
        return target


def lag1_autocorrelation(residuals: list[float]) -> float:
    """The lag-1 autocorrelation of residuals about a fitted line (0 when they are all 0)."""
    total = sum(a * a for a in residuals)
    return sum(a * b for a, b in zip(residuals, residuals[1:])) / total if total else 0.0


def _up(need: float, running: int, margin: float) -> float:
    """``need`` (fractional workers), or ``running`` while the need stands over it by no more than ``margin``
    (a role at 0 starts its first worker at once)."""
    return running if 0 < running < need <= running + margin else need


@dataclass
class ThresholdRule:
    """An HPA on utilisation: desired = ceil(current * utilisation / target), 300 s scale-down window."""

    target: float = 0.7
    down_after_s: float = 300.0
    minimum: int = 1
    _history: dict = field(default_factory=dict)

    def desired(self, role: str, now: float, current: int, utilisation: float) -> int:
        want = max(self.minimum, math.ceil(max(current, 1) * utilisation / self.target))
        history = self._history.setdefault(role, [])
        history.append((now, want))
        while history and history[0][0] < now - self.down_after_s:
            history.pop(0)
        # HPA's stabilisation: scale down only to the highest recommendation of the window
        return want if want >= current else max(w for _, w in history)
