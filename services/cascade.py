"""``model: "auto"``: a cascade over model tiers, and the confidence signal that decides escalation.

A request for ``auto`` runs on the smallest tier first. Its first ``tokens``
generated tokens are held back; their log-probabilities give the tier's own
confidence (``mean`` or ``min`` of them). Under ``threshold`` the answer is
dropped and the request runs again on the next tier; otherwise the held tokens
are released and the tier finishes the answer. The last tier always answers.
This is FrugalGPT's cascade (Chen, Zaharia, Zou 2023, arXiv:2305.05176) with the
generator's own log-probabilities as the scorer instead of a trained one.

The gateway holds the spec (``pdserve gateway --cascade``) and sends it with each
``auto`` request on the queue (``QueuedRequest.cascade``); the router runs it
(services/router/cascade.py), so a router needs no configuration of its own.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from services.errors import InvalidRequestError

AUTO = "auto"
SIGNALS = ("mean", "min")


@dataclass(frozen=True)
class CascadeSpec:
    tiers: tuple[str, ...]  # model names, smallest (first tried) first
    signal: str = "mean"  # mean | min token log-probability over the first `tokens` tokens
    tokens: int = 8
    threshold: float = -1.0  # confidence under this escalates; inf: always, -inf: never

    def __post_init__(self) -> None:
        tiers = tuple(self.tiers)
        object.__setattr__(self, "tiers", tiers)
        if len(tiers) < 2 or len(set(tiers)) != len(tiers) or not all(isinstance(t, str) and t for t in tiers):
            raise ValueError(f"a cascade needs two or more distinct model names, smallest first; got {list(tiers)}")
        if AUTO in tiers:
            raise ValueError(f"{AUTO!r} names the cascade itself, not a tier")
        if self.signal not in SIGNALS:
            raise ValueError(f"the cascade signal must be one of {SIGNALS}; got {self.signal!r}")
        if type(self.tokens) is not int or not 1 <= self.tokens <= 256:
            raise ValueError(f"the cascade's tokens must be an int in [1, 256]; got {self.tokens!r}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or math.isnan(self.threshold):
            raise ValueError(f"the cascade threshold must be a number; got {self.threshold!r}")

    def confidence(self, logprobs: list[float]) -> float:
        """The signal over the first ``tokens`` log-probabilities (0.0, sure, for an empty answer)."""
        first = logprobs[:self.tokens]
        if not first:
            return 0.0
        return min(first) if self.signal == "min" else sum(first) / len(first)

    def escalates(self, logprobs: list[float]) -> bool:
        return self.confidence(logprobs) < self.threshold

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "tiers": list(self.tiers)}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "CascadeSpec":
        """A queued request's spec; a malformed one is bad input (dead-lettered, not retried)."""
        try:
            fields = json.loads(text)
            return cls(tiers=tuple(fields["tiers"]), signal=fields["signal"], tokens=fields["tokens"],
                       threshold=float(fields["threshold"]))
        except (ValueError, TypeError, KeyError) as exc:
            raise InvalidRequestError(f"bad cascade spec in the queue entry: {exc}", param="cascade") from None


def parse_tiers(text: str) -> tuple[str, ...]:
    """``--cascade A,B,C`` -> the tier names."""
    return tuple(name.strip() for name in text.split(",") if name.strip())
