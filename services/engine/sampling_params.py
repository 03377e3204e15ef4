"""Per-request sampling parameters, validated where they are built."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.structured_output import StructuredOutput
from services.errors import InvalidRequestError


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: until the context is full
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token; 0 = just the chosen one
    skip_special_tokens: bool = True
    # What the output must match (response_format, a gRPC regex or grammar); None: free text.
    # A dict (from the queue's JSON) becomes a StructuredOutput.
    structured: StructuredOutput | None = None
    # The LoRA adapter to run the request with (a name the workers know); None: the base model.
    lora: str | None = None
    # Token id -> a bias in [-100, 100] added to its logit before penalties and sampling (OpenAI's
    # logit_bias). Keys may arrive as strings (JSON objects have no integer keys).
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.structured = StructuredOutput.coerce(self.structured)
        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {why}", param=param)

        self.logit_bias = _logit_bias(self.logit_bias, bad)

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # Types first: values come from JSON, and a comparison with the wrong type would
        # surface as a TypeError that names no parameter.
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(name, f"must be a number, got {value!r}")
        for name in ("max_tokens", "top_k", "seed", "logprobs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, int) or (value is None and name != "top_k")):
                raise bad(name, f"must be an integer, got {value!r}")
        if not isinstance(self.stop, list):
            raise bad("stop", f"must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or any(
                isinstance(t, bool) or not isinstance(t, int) for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be a list of integers, got {self.stop_token_ids!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise bad("top_k", f"must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise bad("lora", f"must be an adapter name, got {self.lora!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


MAX_LOGIT_BIAS = 100.0


def _logit_bias(value, bad) -> dict[int, float]:
    """``{token id: bias}`` with integer ids >= 0 and biases in [-100, 100]; the range of the ids
    is checked where the vocabulary is known (the gateway and the engine)."""
    if not isinstance(value, dict):
        raise bad("logit_bias", f"must be an object mapping token ids to biases, got {value!r:.60}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = key
        if isinstance(key, str) and key.strip().isdigit():
            token = int(key)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise bad("logit_bias", f"keys must be token ids (integers >= 0), got {key!r:.40}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"values must be numbers in [-100, 100], got {bias!r:.40} for token {token}")
        out[token] = float(bias)
    return out
