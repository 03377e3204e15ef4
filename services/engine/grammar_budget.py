"""Finish a structured output inside its token budget: the closing path near ``max_tokens``.

A grammar mask guarantees every prefix can still become a match, not that the match ends before
``max_tokens``: a small model that repeats itself inside an unbounded JSON string is cut mid-object
(``finish_reason: length``, output that does not parse). So once a constrained request's remaining
budget comes within ``WINDOW`` tokens, each step looks for a short path from its matcher's state to
an accepting one; when the path (plus the end-of-sequence token) takes all the budget left, the
request is steered onto it (with a few tokens of slack, ``_margin``; searches are spaced by
a quarter of the slack left, so a request far from closing is searched rarely): its mask allows the path's next token only, and the remaining path is
followed to the end. Before that point the model writes freely; after it the output is the
shortest completion found, e.g. ``"}]}`` closing the string, the array and the objects, or the
required keys left with minimal values.

llguidance (1.9) has no shortest-completion query, so the path is searched here, on the request's
own matcher (tokens consumed and rolled back): a depth-first search, bounded in nodes, over the
grammar's forced tokens (``compute_ff_tokens``: a key's remaining characters in one step) and
single-character tokens in a closing-first order (quote, braces, brackets, separators, digits
from 1, letters)). Closing-first
matters: the first branch tried at each point is usually the one that ends soonest. It is not guaranteed to be the shortest, only short; when no path fits, the request is
left alone and ends with ``length`` as before.
"""

from __future__ import annotations

import string

import llguidance

WINDOW = 64  # search for a closing path once the budget left is this many tokens or fewer
MAX_NODES = 3000  # matcher steps per search: bounds the time a search can take
RETRY_AFTER = 4  # tokens before searching again after a search that found nothing
_ORDER = '"}]),:' + "1234567890" + " " + string.ascii_lowercase + string.ascii_uppercase + \
    "".join(c for c in string.printable if c not in string.ascii_letters + string.digits + '"}]),: \t\n\r\x0b\x0c')


def _margin(path_len: int) -> int:
    """Tokens of slack kept when deciding to close. The path found after the model's next token can
    be longer than this one (a multi-character token can leave the grammar mid-key, where the forced
    tokens are single characters), and one token can commit the output to much more (``},`` opens
    another array item: seen to take a path from 9 tokens to over 20). Closing once the budget is
    down to twice the path (16 tokens at least) leaves room for such a step."""
    return max(16, path_len)


class ClosingPath:
    def __init__(self, tokenizer: llguidance.LLTokenizer, eos_token_ids):
        self.eos = list(eos_token_ids)
        ids = []
        for ch in _ORDER:
            toks = tokenizer.tokenize_str(ch)
            if len(toks) == 1 and tokenizer.decode_str(toks) == ch:
                ids.append(toks[0])
        self.candidates = ids
        self.forced: dict[str, list[int]] = {}  # request id -> the rest of the path it is on
        self.due: dict[str, int] = {}  # request id -> the budget at which to search next

    def forget(self, request_id: str) -> None:
        self.forced.pop(request_id, None)
        self.due.pop(request_id, None)

    def next_token(self, request_id: str, matcher: llguidance.LLMatcher, budget: int | None) -> int | None:
        """The token ``request_id`` must take now to end inside ``budget`` more tokens, or None to sample
        freely. Call once per step before the mask; it does not change the matcher's state."""
        path = self.forced.get(request_id)
        if path is None:
            if budget is None or budget > min(WINDOW, self.due.get(request_id, WINDOW)):
                return None
            found = self.search(matcher, budget - 1)  # one token is the end of sequence
            if found is None:  # nothing fits (a failed search is the costly kind): look again later
                self.due[request_id] = budget - RETRY_AFTER
                return None
            slack = budget - (len(found) + 1 + _margin(len(found)))
            if slack > 0:  # room to write freely; the next search when a quarter of the slack is spent
                self.due[request_id] = budget - max(1, slack // 4)
                return None
            path = self.forced[request_id] = found
        if not path:
            return self.eos[0] if self.eos else None
        return path[0]

    def accepted(self, request_id: str, token: int) -> None:
        path = self.forced.get(request_id)
        if path and path[0] == token:
            path.pop(0)

    def search(self, matcher: llguidance.LLMatcher, limit: int) -> list[int] | None:
        """A path of at most ``limit`` tokens to an accepting state (the matcher is left as it was)."""
        nodes = [0]
        path: list[int] = []
        depth = [0]

        def dfs() -> bool:
            if matcher.is_accepting():
                return True
            if len(path) >= depth[0] or nodes[0] >= MAX_NODES:
                return False
            forced = matcher.compute_ff_tokens()
            if forced:
                forced = forced[:depth[0] - len(path)]
                n = matcher.try_consume_tokens(forced)
                nodes[0] += 1
                if n:
                    path.extend(forced[:n])
                    if dfs():
                        return True
                    del path[-n:]
                    matcher.rollback(n)
                    return False  # a forced step is the only way on
            for tok in self.candidates:
                if nodes[0] >= MAX_NODES:
                    return False
                nodes[0] += 1
                if matcher.try_consume_tokens([tok]) != 1:
                    continue
                path.append(tok)
                if dfs():
                    return True
                path.pop()
                matcher.rollback(1)
            return False

        depth[0] = limit
        if not dfs():
            return None
        matcher.rollback(len(path))
        return list(path)
