"""The queue's atomic steps, as Lua scripts run inside Redis.

Each script touches only ``{q}``-tagged keys (see keys.py), so each is one
atomic step on one Cluster slot. The state hash of a request
(``pd:{q}:state:<request_id>``) holds ``first`` (the entry id enqueue
returned), ``entry`` (the live entry id), ``tier``, ``tokens`` (prompt tokens
counted against admission), ``status`` (queued | done | dead | expired) and,
after a retry, ``attempts``, ``last_error`` and ``worker``.

Invariants the scripts keep together:

* a request with status ``queued`` has exactly one entry in its tier stream,
  and its tokens are in the admission hash field ``tokens:<tier>``;
* the move from ``queued`` to a final status happens once, in FINALIZE, with
  the XACK + XDEL of the entry and the token release; a request at a final
  status has no tokens counted and its state key expires after state_ttl_s;
* entries leave a tier stream only by FINALIZE or RETRY (XDEL of processed
  work), never by trimming, so XLEN of a tier stream is its queued requests.
"""

from __future__ import annotations

# KEYS: state, admission hash, target tier stream, dead stream, coalescing key (or any {q} key when
#       ARGV[6] is ""), every tier stream...
# ARGV: tier, prompt tokens, max queued requests, max queued tokens, dead entry id to re-drive or "",
#       coalescing claim value or "", its TTL in ms, then the entry's field/value pairs
# -> {"ok", entry id} | {"exists", first entry id} | {"full", "requests"|"tokens", current}
#    | {"missing"} (no such dead letter) | {"queued", entry id} (re-drive of a request queued again)
#    | {"claimed", value} (the coalescing key names another request: nothing queued)
# With a claim value, the coalescing key is claimed in the same step as the entry is queued (gateway
# coalescing: one round trip for a request that leads), and only when it is: a full queue claims nothing.
ENQUEUE = """
local redrive = ARGV[5]
local claim = ARGV[6]
if claim ~= '' then
  local holder = redis.call('GET', KEYS[5])
  if holder then return {'claimed', holder} end
end
if redrive ~= '' then
  if #redis.call('XRANGE', KEYS[4], redrive, redrive) == 0 then return {'missing'} end
  if redis.call('HGET', KEYS[1], 'status') == 'queued' then
    return {'queued', redis.call('HGET', KEYS[1], 'entry')}
  end
else
  local first = redis.call('HGET', KEYS[1], 'first')
  if first then return {'exists', first} end
end
local queued = 0
for i = 6, #KEYS do queued = queued + redis.call('XLEN', KEYS[i]) end
if queued + 1 > tonumber(ARGV[3]) then return {'full', 'requests', queued} end
local tokens = 0
for _, v in ipairs(redis.call('HVALS', KEYS[2])) do tokens = tokens + tonumber(v) end
if tokens + tonumber(ARGV[2]) > tonumber(ARGV[4]) then return {'full', 'tokens', tokens} end
local fields = {}
for i = 8, #ARGV do fields[#fields + 1] = ARGV[i] end
local id = redis.call('XADD', KEYS[3], '*', unpack(fields))
if claim ~= '' then redis.call('SET', KEYS[5], claim, 'PX', ARGV[7]) end
redis.call('HINCRBY', KEYS[2], 'tokens:' .. ARGV[1], ARGV[2])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'first', id, 'entry', id, 'tier', ARGV[1], 'tokens', ARGV[2], 'status', 'queued')
if redrive ~= '' then redis.call('XDEL', KEYS[4], redrive) end
return {'ok', id}
"""

# KEYS: tier stream, dead stream, admission hash, state
# ARGV: group, entry id, final status (done | dead | expired), state TTL seconds,
#       then (status dead only) the dead letter's field/value pairs
# -> the dead letter's entry id, or "".
# The dead-letter XADD comes first: if it fails the script stops before the XACK,
# and the entry stays pending to be reclaimed; it is never acked unrecorded.
FINALIZE = """
local dead_id = ''
if ARGV[3] == 'dead' then
  local fields = {}
  for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
  dead_id = redis.call('XADD', KEYS[2], '*', unpack(fields))
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
if redis.call('HGET', KEYS[4], 'status') == 'queued' then
  local tier = redis.call('HGET', KEYS[4], 'tier')
  local tokens = tonumber(redis.call('HGET', KEYS[4], 'tokens'))
  redis.call('HINCRBY', KEYS[3], 'tokens:' .. tier, -tokens)
  redis.call('HSET', KEYS[4], 'status', ARGV[3])
  redis.call('EXPIRE', KEYS[4], ARGV[4])
end
return dead_id
"""

# KEYS: tier stream, state
# ARGV: group, consumer, entry id, attempts so far, last error, worker, then the request's field/value pairs
# -> the new entry id, or nil when this consumer no longer owns the entry (another reclaimed it).
# The entry is re-added at the tail of its tier so that any consumer's XREADGROUP ">" sees it again;
# its delivery history travels in the ``attempts`` field.
RETRY = """
local owner = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #owner == 0 or owner[1][2] ~= ARGV[2] then return false end
local fields = {}
for i = 7, #ARGV do fields[#fields + 1] = ARGV[i] end
for _, kv in ipairs({{'attempts', ARGV[4]}, {'last_error', ARGV[5]}, {'last_worker', ARGV[6]}}) do
  fields[#fields + 1] = kv[1]
  fields[#fields + 1] = kv[2]
end
local id = redis.call('XADD', KEYS[1], '*', unpack(fields))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('HSET', KEYS[2], 'entry', id, 'attempts', ARGV[4], 'last_error', ARGV[5], 'worker', ARGV[6])
end
return id
"""

# Smooth weighted round-robin (nginx's) over the tiers that have undelivered entries.
# KEYS: tier streams, highest first
# ARGV: group, consumer, count, then one weight per tier, then one current weight per tier
# -> {{{tier index, entry id, {field, value, ...}}, ...}, {current weights}, {last entry id per tier}}
# (the last ids only when nothing was read: the caller blocks on new entries after them).
# Each pick adds every live tier's weight to its current weight, takes the largest (ties go to
# the higher tier) and subtracts the live total from the winner. A tier found empty leaves the
# live set and the round is undone, so an idle tier neither blocks the others nor banks credit.
DEQUEUE = """
local n = #KEYS
local group, consumer, count = ARGV[1], ARGV[2], tonumber(ARGV[3])
local weight, current, live = {}, {}, {}
for i = 1, n do
  weight[i] = tonumber(ARGV[3 + i])
  current[i] = tonumber(ARGV[3 + n + i])
  live[i] = true
end
local out = {}
while #out < count do
  local total, best = 0, nil
  for i = 1, n do
    if live[i] then
      total = total + weight[i]
      current[i] = current[i] + weight[i]
      if best == nil or current[i] > current[best] then best = i end
    end
  end
  if best == nil then break end
  local r = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', 1, 'STREAMS', KEYS[best], '>')
  if r and #r[1][2] > 0 then
    current[best] = current[best] - total
    out[#out + 1] = {best, r[1][2][1][1], r[1][2][1][2]}
  else
    for i = 1, n do
      if live[i] then current[i] = current[i] - weight[i] end
    end
    live[best] = false
  end
end
local last = {}
if #out == 0 then
  for i = 1, n do
    local e = redis.call('XREVRANGE', KEYS[i], '+', '-', 'COUNT', 1)
    last[i] = (#e > 0) and e[1][1] or '0-0'
  end
end
return {out, current, last}
"""


class Scripts:
    """The scripts registered on one client (redis-py loads each by SHA, re-sending it after a flush)."""

    def __init__(self, redis):
        self.enqueue = redis.register_script(ENQUEUE)
        self.finalize = redis.register_script(FINALIZE)
        self.retry = redis.register_script(RETRY)
        self.dequeue = redis.register_script(DEQUEUE)
