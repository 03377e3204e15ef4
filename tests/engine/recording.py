"""Test-only taps on an Engine: what the scheduler ran and which logits the sampler saw."""

from __future__ import annotations

from collections import defaultdict

from services.engine.engine import Engine


class Recorder:
    def __init__(self, engine: Engine):
        self.scheduled: dict[str, list[int]] = defaultdict(list)  # request id -> num_new_tokens per step
        self.logits: dict[str, list] = defaultdict(list)  # request id -> logits row per sampled token
        self.steps: list[list[int]] = []  # num_new_tokens of every scheduled request, per step
        schedule, sampler = engine.scheduler.schedule, engine.sampler

        def record_schedule():
            out = schedule()
            self.steps.append([s.num_new_tokens for s in out.scheduled])
            for s in out.scheduled:
                self.scheduled[s.request.request_id].append(s.num_new_tokens)
            return out

        class RecordingSampler:
            def __getattr__(self, name):
                return getattr(sampler, name)

            def __call__(_, logits, reqs):
                for row, req in zip(logits, reqs):
                    self.logits[req.request_id].append(row.clone())
                return sampler(logits, reqs)

        engine.scheduler.schedule = record_schedule
        engine.sampler = RecordingSampler()


def run_to_completion(engine: Engine) -> dict[str, list]:
    """Step until idle; returns request id -> outputs."""
    outs: dict[str, list] = defaultdict(list)
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs
