"""What an engine step hands out: plain data, no torch, so it crosses process boundaries.

The gRPC codec (``services/grpc_codec.py``), the decode service's Redis writer and the
hand-off read these without importing the engine; the router and the gateway never
import more of the engine than this, ``sampling_params.py`` and ``block_hash.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-n (token id, logprob), best first

    def to_json(self) -> dict:
        """Plain data for a message between processes (the prefill worker sends the first token's)."""
        return {"token_id": self.token_id, "logprob": self.logprob, "top": [[t, p] for t, p in self.top]}

    @classmethod
    def from_json(cls, data: dict) -> TokenLogprobs:
        return cls(int(data["token_id"]), float(data["logprob"]), [(int(t), float(p)) for t, p in data["top"]])


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | prefilled | error
    logprobs: list[TokenLogprobs | None] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (prefill progress)
    block_ids: list[int] | None = None  # prefill-only requests: the blocks holding the prompt's KV
    error: str | None = None  # set with finish_reason "error"
