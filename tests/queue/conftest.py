import itertools

from services.queue import QueuedRequest

_ids = itertools.count()


def make_request(tier: str = "standard", tokens: int = 4, **overrides) -> QueuedRequest:
    n = next(_ids)
    fields = {"request_id": f"req-{n}", "tenant": "acme", "tier": tier, "model": "smollm2",
              "token_ids": [(n * 7 + i) % 1000 for i in range(tokens)],
              "sampling": {"temperature": 0.0, "max_tokens": 8}}
    fields.update(overrides)
    return QueuedRequest(**fields)
