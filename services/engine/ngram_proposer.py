"""Prompt-lookup drafts: guess a request's next tokens by finding its last few tokens earlier in
its own text (prompt and output) and copying what followed them there. No model, no torch.

For each n from ``max_n`` down to ``min_n``, the suffix n-gram is looked up among the n-grams
that end before the current end; the latest match wins, and the tokens after it are the draft::

    tokens:  ... a b c d e f ... x y a b c            (suffix "a b c", n = 3)
                 \\___/ \\___/
                 match  draft (up to k tokens: "d e f ...")

A match near the end (a loop) runs into the sequence's own end; the draft then continues as
the loop would, copying its own first tokens (period ``end - e``), so a repeating text gets
full-length drafts.

Each request has an incremental index (n-gram -> end of its latest occurrence), extended by the
tokens appended since the last call, so a step costs a few dict operations per request, not a
scan of its context.
"""

from __future__ import annotations


class NgramIndex:
    """Latest end position of every n-gram (``min_n <= n <= max_n``) of one growing sequence."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self._indexed = 0  # n-grams ending at positions <= this are in the index

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens following the latest earlier occurrence of the longest matching
        suffix of ``tokens``; empty when no suffix of ``min_n`` or more tokens occurred before."""
        end = len(tokens)
        if k < 1 or end < self.min_n + 1:
            return []
        # index every n-gram ending before ``end`` (the suffix itself must not match itself)
        for e in range(max(self._indexed + 1, self.min_n), end):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                self._ends[n][tuple(tokens[e - n : e])] = e
        self._indexed = max(self._indexed, end - 1)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            e = self._ends[n].get(tuple(tokens[end - n :]))
            if e is not None:
                draft: list[int] = []
                for i in range(k):
                    j = e + i
                    draft.append(tokens[j] if j < end else draft[j - end])
                return draft
        return []
