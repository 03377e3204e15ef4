"""A day compressed into a shorter simulated one, and every time constant measured against it.

The autoscaling runs cannot simulate a real day at tens of workers (a million requests a run),
so the day is compressed by ``k = 86,400 s / period_s``. Compressing only the day would make
its ramp k times steeper against a worker's cold start than a real day's (a 120 s cold start in
a 1,800 s day is a 96-minute cold start in a real one), and the result would say more about the
compression than about the autoscaler. So every time the autoscalers and the trace's shape
measure against the day is divided by k as well:

* the worker's cold and warm start (the profile's ``cold_start_s``, ``warm_start_s``);
* the controller's tick (10 s), and the router's heartbeat where the tick is shorter (the
  signals cannot be fresher than the heartbeat that carries them);
* the planner's hysteresis (``down_after_s``) and scale-down spacing (``down_every_s``), trend window
  and lookahead (one cold start), boost spacing, SLO window, warm-pool confirmation, standby
  hold and idle-to-zero time; the threshold rule's 300 s stabilisation window;
* the trace's bursts (120 s each, twice a day).

What is not compressed: what one request does (prefill and decode times, KV transfer, the TTFT
and ITL SLOs, a chat's 30 s between turns). That is the compression's one distortion: a burst
lasts k times fewer requests' service times, so its backlog against the TTFT SLO is smaller than
a real day's. ``bench sim --period-s`` runs a less compressed day to show what that changes.
"""

from __future__ import annotations

import dataclasses

from services.planner.policy import PlannerConfig
from services.sim.profiles import WorkerProfile

REAL_DAY_S = 86_400.0
TICK_S = 10.0  # the controller's decision interval in a real day (pdserve planner's --interval)
BURST_S = 120.0  # a burst's length in a real day
HPA_WINDOW_S = 300.0  # the HPA's default scale-down stabilisation


@dataclasses.dataclass(frozen=True)
class DayScale:
    period_s: float  # the simulated day

    def __post_init__(self) -> None:
        if not 0 < self.period_s <= REAL_DAY_S:
            raise ValueError(f"the simulated day must be in (0, {REAL_DAY_S:.0f}] s")

    @property
    def k(self) -> float:
        return REAL_DAY_S / self.period_s

    def s(self, real_s: float) -> float:
        """A time measured against the day, in the simulated day's seconds."""
        return real_s / self.k

    @property
    def tick_s(self) -> float:
        return self.s(TICK_S)

    @property
    def heartbeat_s(self) -> float:
        return min(1.0, self.tick_s)

    @property
    def burst_s(self) -> float:
        return self.s(BURST_S)

    @property
    def hpa_window_s(self) -> float:
        return self.s(HPA_WINDOW_S)

    def profile(self, profile: WorkerProfile) -> WorkerProfile:
        return dataclasses.replace(profile, cold_start_s=self.s(profile.cold_start_s),
                                   warm_start_s=self.s(profile.warm_start_s))

    def planner(self, config: PlannerConfig, real_cold_start_s: float | None = None) -> PlannerConfig:
        """``config``'s day-measured times compressed; ``real_cold_start_s``: set the lookahead to it first."""
        lookahead = config.lookahead_s if real_cold_start_s is None else real_cold_start_s
        return dataclasses.replace(config, down_after_s=self.s(config.down_after_s),
                                   idle_to_zero_s=self.s(config.idle_to_zero_s), lookahead_s=self.s(lookahead),
                                   trend_window_s=self.s(config.trend_window_s),
                                   boost_every_s=self.s(config.boost_every_s), slo_window_s=self.s(config.slo_window_s),
                                   down_every_s=self.s(config.down_every_s),
                                   warm_confirm_s=self.s(config.warm_confirm_s),
                                   standby_hold_s=self.s(config.standby_hold_s),
                                   forecast_level_s=self.s(config.forecast_level_s),
                                   warm_min_ahead_s=self.s(config.warm_min_ahead_s))
