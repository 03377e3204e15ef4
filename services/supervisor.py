"""Keeping a local stack's processes running: a child that dies is started again, with backoff.

``pdserve up`` calls ``check()`` twice a second. A child found dead is restarted
after a delay that doubles each time it dies again soon after starting (1 s,
2 s, 4 s, ... at most ``max_backoff_s``) and goes back to 1 s once it has run
``stable_s``; every death and restart is said on the console. What a dead
worker held is recovered elsewhere, as without a supervisor: the router
re-drives a dead decode worker's requests on another one (resuming after the
tokens already sent) and retries a dead prefill worker's prefill; a router's
unacknowledged queue entries are reclaimed by the next router. A restarted
worker registers afresh and the router picks it up from the registry.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from services.launcher import LocalStack


@dataclass
class _Restart:
    at: float  # time.monotonic() when to start it again
    failures: int  # deaths in a row, each soon after its start


class Supervisor:
    def __init__(self, stack: LocalStack, say: Callable[[str], None], base_backoff_s: float = 1.0,
                 max_backoff_s: float = 30.0, stable_s: float = 60.0):
        self.stack, self.say = stack, say
        self.base_backoff_s, self.max_backoff_s, self.stable_s = base_backoff_s, max_backoff_s, stable_s
        self.pending: dict[str, _Restart] = {}
        self.failures: dict[str, int] = {}
        self.restarts = 0

    def check(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for p in self.stack.dead():
            if p.name in self.pending:
                continue
            ran = now - p.started_at
            failures = 1 if ran >= self.stable_s else self.failures.get(p.name, 0) + 1
            self.failures[p.name] = failures
            delay = min(self.max_backoff_s, self.base_backoff_s * 2 ** (failures - 1))
            self.pending[p.name] = _Restart(now + delay, failures)
            self.say(f"{p.name} exited (status {p.proc.returncode}) after {ran:.0f} s; "
                     f"restarting it in {delay:g} s (restart {self.restarts + 1})")
        for name, due in list(self.pending.items()):
            if now >= due.at:
                del self.pending[name]
                self.restarts += 1
                self.stack.procs[name].restart()
                self.say(f"{name} restarted (pid {self.stack.procs[name].proc.pid})")
