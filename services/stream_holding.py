"""How a decode worker holds a request's tokens before writing them to its result stream: the flags and defaults.

    interval, flush_ms = resolve(args.stream_interval, args.stream_flush_ms)   # None: not given

Every chunk written costs the decode worker, Redis, the gateway and the client a
wake-up and CPU, which on a machine without a GPU is taken from the engine's
cores (BENCHMARKS.md, ``bench hops``). Two ways to hold tokens, one at a time
(services/decode/step_results.py applies them):

- ``--stream-flush-ms M`` (default ``STREAM_FLUSH_MS``): at most one write per
  request per M ms; the first token and the last at once. Steps slower than M
  ms (a batch of many, a large model) are written one by one, so only fast
  steps, one user on a small model, coalesce. 0: every step is written.
- ``--stream-interval N``, vLLM's and SGLang's flag: N tokens to a chunk. Given
  alone it replaces the time-based flush, so ``--stream-interval 1`` streams
  every token as vLLM and SGLang do by default.

Torch-free: ``pdserve up`` checks the flags before it starts anything.
"""

from __future__ import annotations

import argparse
import math

# ms between two writes of one request's tokens, unless a flag says otherwise: chosen by measurement
# (BENCHMARKS.md, "Time-based stream flush"); under two frames of a 60 Hz display
STREAM_FLUSH_MS = 20.0
MAX_FLUSH_MS = 1000.0  # a held token must still look like a stream


def check(interval: int, flush_ms: float) -> None:
    """Refuse what no writer can do: ValueError with what to change."""
    if interval < 1:
        raise ValueError(f"stream interval must be >= 1, got {interval}")
    if not 0 <= flush_ms <= MAX_FLUSH_MS:  # NaN too
        raise ValueError(f"stream flush must be 0-{MAX_FLUSH_MS:g} ms, got {flush_ms}")
    if interval > 1 and flush_ms > 0:
        raise ValueError("--stream-interval (tokens per chunk) and --stream-flush-ms (ms between writes) are two "
                         "ways to hold tokens: give one")


def resolve(interval: int | None, flush_ms: float | None) -> tuple[int, float]:
    """``(interval, flush_ms)`` from the flags given (None: not given): the time-based default unless
    ``--stream-interval`` is given; both given with a flush over 0 is refused."""
    if interval is not None and flush_ms is not None and flush_ms > 0:
        check(max(interval, 2), flush_ms)  # raises: two ways at once
    got = (interval if interval is not None else 1,
           flush_ms if flush_ms is not None else (0.0 if interval is not None else STREAM_FLUSH_MS))
    check(*got)
    return got


def _ms(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds, got {text!r}") from None
    if not (math.isfinite(value) and 0 <= value <= MAX_FLUSH_MS):
        raise argparse.ArgumentTypeError(f"must be 0-{MAX_FLUSH_MS:g} ms, got {text}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--stream-flush-ms`` and ``--stream-interval`` (``pdserve decode`` and ``pdserve up``)."""
    from services.bench.args import at_least_one

    p.add_argument("--stream-flush-ms", type=_ms, default=None, metavar="MS",
                   help="the decode worker writes each request's tokens to its result stream at most once per MS ms "
                        "(the first token and the last at once); steps slower than MS are written one by one. Each write "
                        "costs the worker, Redis, the gateway and the client CPU, which on a small machine is "
                        f"the engine's (BENCHMARKS.md). Default {STREAM_FLUSH_MS:g}; 0: every token as it comes")
    p.add_argument("--stream-interval", type=at_least_one, default=None, metavar="N",
                   help="instead of --stream-flush-ms: a request's tokens go N to a chunk (the first and the "
                        "last at once), as vLLM's and SGLang's --stream-interval; 1: every token as it comes")
