"""Per-tenant request and token budgets: two token buckets in Redis, shared by every gateway replica.

Each tenant has one hash ``pd:gw:rl:<tenant>`` holding both bucket levels and
when they were last updated. A bucket holds at most one minute's budget and
refills continuously (``rpm`` requests / ``tpm`` tokens per 60 s), so a tenant
may burst its whole minute at once and then goes at the steady rate. One Lua
script refills, checks and takes both buckets atomically, on Redis' own clock
(``TIME``), so replicas with skewed clocks still share one budget. A refused
request takes nothing.

A request costs 1 request and prompt tokens + max output tokens, counted at
admission (what OpenAI counts against ``tpm``); a request refused after that
(the queue full or unavailable at enqueue time) gets its budget back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.errors import InvalidRequestError
from services.gateway.api_keys import Tenant
from services.errors import RateLimitError

_WINDOW_MS = 60_000

# KEYS[1] the tenant's bucket hash. ARGV: rpm, tpm (0: unlimited), token cost.
# Returns {allowed (0|1), requests left, tokens left, wait ms until it would be allowed}.
_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rpm, tpm, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local b = redis.call('HMGET', KEYS[1], 'req', 'tok', 'ts')
local req = tonumber(b[1]) or rpm
local tok = tonumber(b[2]) or tpm
local dt = math.max(0, now - (tonumber(b[3]) or now))
req = math.min(rpm, req + dt * rpm / 60000)
tok = math.min(tpm, tok + dt * tpm / 60000)
local wait = 0
if rpm > 0 and req < 1 then wait = math.max(wait, (1 - req) * 60000 / rpm) end
if tpm > 0 and tok < cost then wait = math.max(wait, (cost - tok) * 60000 / tpm) end
local allowed = 0
if wait == 0 then
  allowed = 1
  if rpm > 0 then req = req - 1 end
  if tpm > 0 then tok = tok - cost end
end
redis.call('HSET', KEYS[1], 'req', tostring(req), 'tok', tostring(tok), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], 120000)
return {allowed, tostring(req), tostring(tok), tostring(wait)}
"""


# KEYS[1] the tenant's bucket hash. ARGV: rpm, tpm (0: unlimited), token cost. Puts back what a
# take took, capped at the bucket's size (a request refused after its budget was taken).
_GIVE_BACK = """
local rpm, tpm, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local b = redis.call('HMGET', KEYS[1], 'req', 'tok')
if not b[1] then return 0 end
local req, tok = tonumber(b[1]), tonumber(b[2])
if rpm > 0 then req = math.min(rpm, req + 1) end
if tpm > 0 then tok = math.min(tpm, tok + cost) end
redis.call('HSET', KEYS[1], 'req', tostring(req), 'tok', tostring(tok))
return 1
"""


def bucket_key(tenant: str) -> str:
    return f"pd:gw:rl:{tenant}"


def _duration(seconds: float) -> str:
    """OpenAI's reset format: ``1s``, ``6m0s``, ``250ms``."""
    if seconds < 1:
        return f"{max(0, int(seconds * 1000))}ms"
    minutes, secs = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


@dataclass(frozen=True)
class RateStatus:
    rpm: int
    tpm: int
    requests_left: float
    tokens_left: float
    wait_s: float  # 0 when the request was allowed

    def headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for the limits the tenant has (none when unlimited)."""
        out = {}
        if self.rpm:
            out["x-ratelimit-limit-requests"] = str(self.rpm)
            out["x-ratelimit-remaining-requests"] = str(max(0, math.floor(self.requests_left)))
            out["x-ratelimit-reset-requests"] = _duration((self.rpm - self.requests_left) * 60 / self.rpm)
        if self.tpm:
            out["x-ratelimit-limit-tokens"] = str(self.tpm)
            out["x-ratelimit-remaining-tokens"] = str(max(0, math.floor(self.tokens_left)))
            out["x-ratelimit-reset-tokens"] = _duration((self.tpm - self.tokens_left) * 60 / self.tpm)
        return out


class RateLimiter:
    def __init__(self, redis):
        self.redis = redis
        self._take = redis.register_script(_TAKE)
        self._give_back = redis.register_script(_GIVE_BACK)

    async def take(self, tenant: Tenant, tokens: int) -> RateStatus:
        """Take one request and ``tokens`` from the tenant's budgets, or raise ``RateLimitError``."""
        if not tenant.rpm and not tenant.tpm:
            return RateStatus(0, 0, 0, 0, 0.0)
        if tenant.tpm and tokens > tenant.tpm:
            raise InvalidRequestError(
                f"this request needs {tokens} tokens (prompt + max_tokens) but the API key's budget is "
                f"{tenant.tpm} tokens per minute; lower max_tokens or shorten the prompt", param="max_tokens")
        allowed, req, tok, wait = await self._take(keys=[bucket_key(tenant.name)],
                                                   args=[tenant.rpm, tenant.tpm, tokens])
        status = RateStatus(tenant.rpm, tenant.tpm, float(req), float(tok), float(wait) / 1000)
        if not int(allowed):
            which = "requests" if tenant.rpm and status.requests_left < 1 else "tokens"
            raise RateLimitError(f"rate limit reached for tenant {tenant.name!r} ({which} per minute); "
                                 f"retry after {status.wait_s:.2f} s", status.wait_s, status.headers())
        return status

    async def give_back(self, tenant: Tenant, tokens: int) -> None:
        """Undo a ``take`` whose request was then refused (the queue full, Redis unavailable): a
        refused request spends no budget. Best effort: when Redis is what failed, it cannot be told."""
        if not tenant.rpm and not tenant.tpm:
            return
        try:
            await self._give_back(keys=[bucket_key(tenant.name)], args=[tenant.rpm, tenant.tpm, tokens])
        except Exception:  # noqa: BLE001 (the refusal the client gets matters more than this)
            pass
