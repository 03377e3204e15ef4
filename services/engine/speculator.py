"""Which running requests draft how many tokens this step, and how drafting has paid off. No torch.

Before each step the engine asks for drafts for every running request that is decoding (one
token to compute). A draft is verified in that step's forward pass: the request runs its last
token plus the draft tokens (``ScheduledRequest.spec_token_ids``), the model scores every one,
the sampler keeps the longest prefix the model agrees with plus one token of its own, and the
KV written for the rest is never counted as computed (the next step overwrites those slots; no
block holding them is ever hashed into the prefix cache).

Drafts are capped so a step never runs past the request's ``max_tokens`` or the context.

Adaptive per request, as a draft costs a row of compute whether or not it is accepted:

- Draft length: a request starts at k; a wholly accepted draft lengthens its next one by 2,
  any rejection shortens it by 1 (not below 1), the schedule HF transformers uses for its
  assistant models. Copying text settles at k; open-ended text, at 1-token drafts.
- Off-switch: a request whose drafts keep being rejected (open-ended text, where a copied
  continuation is seldom right) still pays for one row a step. Over its last ``window``
  verifying steps, if fewer than ``min_acceptance`` of its draft tokens were accepted, it
  stops drafting for ``backoff`` output tokens, then probes again; each failed probe doubles
  the pause (up to ``MAX_BACKOFF``), a good window resets it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.config import SpeculativeConfig
from services.engine.ngram_proposer import NgramIndex
from services.engine.request import Request

FIRST_BACKOFF = 16  # output tokens without drafts after the first low-acceptance window
MAX_BACKOFF = 512


@dataclass
class _RequestState:
    index: NgramIndex
    draft_len: int  # tokens to draft next (at most)
    recent: deque = field(default_factory=deque)  # (drafted, accepted) of the latest verifying steps
    paused_until: int = 0  # no drafts before this many output tokens
    backoff: int = FIRST_BACKOFF


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self._states: dict[str, _RequestState] = {}
        # totals, for stats and the bench
        self.num_drafts = 0  # verifying steps (requests x steps that carried a draft)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_pauses = 0

    def propose(self, running: list[Request]) -> None:
        """Set ``spec_token_ids`` of every running request: a draft for those decoding, else none."""
        for req in running:
            req.spec_token_ids = self._draft(req) if req.num_tokens - req.num_computed_tokens == 1 else []

    def _draft(self, req: Request) -> list[int]:
        if req.prefill_only:
            return []
        state = self._states.get(req.request_id)
        if state is None:
            cfg = self.config
            state = self._states[req.request_id] = _RequestState(
                NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max), cfg.num_speculative_tokens)
        # verifying k drafts yields up to k + 1 tokens: stay within max_tokens and the context
        k = min(state.draft_len, self.max_model_len - req.num_tokens - 1)
        if req.params.max_tokens is not None:
            k = min(k, req.params.max_tokens - req.num_output_tokens - 1)
        if k < 1 or req.num_output_tokens < state.paused_until:
            return []
        return state.index.propose(req.all_token_ids, k)

    def record(self, req: Request, drafted: int, accepted: int) -> None:
        """A verifying step's outcome for ``req``: ``accepted`` of its ``drafted`` tokens kept."""
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        state = self._states.get(req.request_id)
        if state is None:
            return
        if accepted == drafted:
            state.draft_len = min(self.config.num_speculative_tokens, state.draft_len + 2)
        else:
            state.draft_len = max(1, state.draft_len - 1)
        state.recent.append((drafted, accepted))
        if len(state.recent) < self.config.window:
            return
        total = sum(d for d, _ in state.recent)
        kept = sum(a for _, a in state.recent)
        state.recent.popleft()
        if kept >= self.config.min_acceptance * total:
            state.backoff = FIRST_BACKOFF
            return
        state.paused_until = req.num_output_tokens + state.backoff
        state.backoff = min(2 * state.backoff, MAX_BACKOFF)
        state.recent.clear()
        self.num_pauses += 1

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def stats(self) -> dict[str, float]:
        return {"spec_drafts": self.num_drafts, "spec_draft_tokens": self.num_draft_tokens,
                "spec_accepted_tokens": self.num_accepted_tokens, "spec_pauses": self.num_pauses}

    @staticmethod
    def no_stats() -> dict[str, float]:
        """The same keys for an engine without speculation (metrics exporters read them all)."""
        return dict.fromkeys(("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "spec_pauses"), 0)
