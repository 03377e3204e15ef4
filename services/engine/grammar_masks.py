"""The engine's structured-output state: a matcher per constrained request, the token masks.

Each step, for the constrained requests that sample in it::

    step():  schedule -> begin(sampling requests)     masks computed on a helper thread
                         runner.execute(...)           ... while the forward runs
             sample   -> masks(rows) (waits)           disallowed tokens -> -inf in the sampler
             append   -> accept(request, token)        each matcher advances by its token

llguidance drops the GIL while it fills masks, and so do torch's kernels, so the two overlap.
A matcher only allows end-of-sequence where its grammar accepts, so a constrained request ends
with ``stop`` on a complete match. Near its token budget (max_tokens or the context) a request is
steered onto a short completion of its grammar (``grammar_budget.py``), so it still ends with a
match; only where no completion fits the budget left does it end with ``length`` mid-match.

Disaggregated serving: the prefill engine samples the first token through the same masks; the
decode engine's matcher starts in the start state and consumes that first token in
``start_decode``, like every token after it (``StructuredOutput.replay`` does the same for a
request resumed on another decode worker with tokens already streamed).

Speculative decoding does not draft for constrained requests (the engine leaves them out).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.numpy as llnp
import numpy as np
import torch

from services.engine.grammar import GrammarCompiler
from services.engine.grammar_budget import ClosingPath
from services.engine.request import Request

log = logging.getLogger(__name__)


class StructuredDecoding:
    def __init__(self, compiler: GrammarCompiler, threads: int = 1, max_model_len: int | None = None):
        self.compiler = compiler
        self.max_model_len = max_model_len
        self.closing = ClosingPath(compiler.tokenizer, compiler.eos_token_ids)
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._executor = llguidance.LLExecutor(num_threads=threads)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._bitmask = llnp.allocate_token_bitmask(8, compiler.vocab_size)

    @property
    def active(self) -> bool:
        return bool(self._matchers)

    def add(self, req: Request) -> None:
        """Start ``req``'s matcher (compiling its spec unless cached); InvalidRequestError if it
        does not compile or its replay tokens do not match it."""
        spec = req.params.structured
        if spec is None:
            return
        matcher = self.compiler.matcher(spec)
        if spec.replay and not matcher.consume_tokens(list(spec.replay)):
            from services.errors import InvalidRequestError

            raise InvalidRequestError("the tokens already generated do not match the structured output",
                                      param="response_format")
        self._matchers[req.request_id] = matcher

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self.closing.forget(request_id)

    def _budget(self, req: Request) -> int | None:
        """Tokens ``req`` may still produce, this step's included; None: no limit near."""
        left = [req.params.max_tokens - req.num_output_tokens] if req.params.max_tokens is not None else []
        if self.max_model_len is not None:
            left.append(self.max_model_len - req.num_tokens)
        return min(left) if left else None

    def begin(self, reqs: list[Request]) -> Future | None:
        """Compute the masks of the constrained ones among ``reqs`` (those sampling this step) on
        the helper thread; ``masks`` collects them."""
        rows = [(m, req.request_id, self._budget(req)) for req in reqs
                if (m := self._matchers.get(req.request_id)) is not None]
        if not rows:
            return None
        if len(rows) > self._bitmask.shape[0]:
            self._bitmask = llnp.allocate_token_bitmask(len(rows), self.compiler.vocab_size)
        bitmask = self._bitmask
        return self._pool.submit(self._fill, rows, bitmask)

    def _fill(self, rows, bitmask: np.ndarray) -> tuple[dict[str, int], np.ndarray]:
        """On the helper thread: the bitmasks, then one bool per token (numpy: torch's element-wise
        ops on a few hundred thousand elements cost tens of milliseconds on a busy 2-core CPU,
        numpy's unpackbits tens of microseconds)."""
        llnp.fill_next_token_bitmask_par(self._executor, [(m, i) for i, (m, _, _) in enumerate(rows)], bitmask)
        words = bitmask[: len(rows)]
        allowed = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little").view(bool)
        for i, (matcher, rid, budget) in enumerate(rows):
            token = self.closing.next_token(rid, matcher, budget)
            if token is not None:  # the budget left is what the grammar needs to finish: its next token only
                allowed[i] = False
                allowed[i, token] = True
        return {rid: i for i, (_, rid, _) in enumerate(rows)}, allowed

    def masks(self, job: Future | None, reqs: list[Request], vocab: int, device) -> torch.Tensor | None:
        """Per row of ``reqs``: True where the token is disallowed (all False for an unconstrained
        row); None when no row is constrained."""
        if job is None:
            return None
        index, allowed = job.result()
        order = [index.get(r.request_id, -1) for r in reqs]
        if all(i < 0 for i in order):
            return None
        blocked = np.zeros((len(reqs), vocab), dtype=bool)
        for row, i in enumerate(order):
            if i < 0:
                continue
            np.logical_not(allowed[i, :vocab], out=blocked[row])
            if blocked[row].all():
                # a matcher in an error state allows nothing: end the request instead of sampling garbage
                log.warning("structured output of %s allows no token (%s); ending it",
                            reqs[row].request_id, self._matchers[reqs[row].request_id].get_error())
                blocked[row, list(reqs[row].eos_token_ids)] = False
        return torch.from_numpy(blocked).to(device)

    def accept(self, req: Request, token: int) -> None:
        matcher = self._matchers.get(req.request_id)
        if matcher is not None:
            self.closing.accepted(req.request_id, token)
        if matcher is not None and not matcher.consume_token(token) and token not in req.eos_token_ids:
            log.warning("structured output of %s refused token %d: %s", req.request_id, token, matcher.get_error())

    def stats(self) -> dict[str, int]:
        return {"structured_running": len(self._matchers), **self.compiler.stats()}
