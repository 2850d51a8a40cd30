-- cronlease claim (see docs/protocol.md), one atomic step on the Redis server's clock.
-- KEYS[1] lease key: the owner, with a TTL (PX) equal to the lease
-- KEYS[2] state hash, never expires: fence, last_occurrence, owner, modified_at
-- ARGV[1] owner  ARGV[2] occurrence (ms)  ARGV[3] previous occurrence (ms) or ""
-- ARGV[4] lease (ms)  ARGV[5] fence floor (decimal u64)  ARGV[6] "run_once" or "skip"
-- ARGV[7] max clock offset (ms): an occurrence later than now + this is refused
-- Reply: {won, fence (decimal string), occurrence, catch_up, holder_or_previous_owner,
--         remaining_ms, last_occurrence_or_-1, now_ms, too_early, repaired}
-- won is -1 when the fence is at its maximum (2^63-1): nothing is written.
-- Fences are kept exact: Lua numbers are doubles, so they are compared as
-- decimal strings and incremented with HINCRBY (64-bit integers).
local MAX_FENCE = '9223372036854775807'
local function greater(a, b)
  if #a ~= #b then return #a > #b end
  return a > b
end
local function decimal(s)
  if s and string.match(s, '^%d+$') then
    s = string.gsub(s, '^0+', '')
    if s == '' then return '0' end
    return s
  end
  return '0'
end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local holder = redis.call('GET', KEYS[1])
local remaining = 0
local repaired = 0
if holder then
  remaining = redis.call('PTTL', KEYS[1])
  if remaining == -1 and holder ~= ARGV[1] then
    -- A lease with no expiry (a hand SET or PERSIST) would block the job
    -- forever. Give it one lease from now: a live holder keeps it by
    -- renewing, a dead one loses it then.
    redis.call('PEXPIRE', KEYS[1], ARGV[4])
    remaining = tonumber(ARGV[4])
    repaired = 1
  end
  if remaining < 0 then remaining = 0 end
end
local state = redis.call('HMGET', KEYS[2], 'fence', 'last_occurrence', 'owner')
local fence = decimal(state[1])
local last = tonumber(state[2])
local occurrence = tonumber(ARGV[2])

if (holder and holder ~= ARGV[1]) or (last and last >= occurrence) then
  return {0, fence, 0, 0, holder or false, remaining, last or -1, now_ms, 0, repaired}
end
if occurrence > now_ms + (tonumber(ARGV[7]) or 0) then
  return {0, fence, 0, 0, holder or false, remaining, last or -1, now_ms, 1, repaired}
end
local floor = decimal(ARGV[5])
local base = fence
if greater(floor, base) then base = floor end
if not greater(MAX_FENCE, base) then
  return {-1, fence, 0, 0, holder or false, remaining, last or -1, now_ms, 0, repaired}
end

local claimed = ARGV[2]
local catch_up = 0
if ARGV[6] == 'run_once' and ARGV[3] ~= '' and last and last < tonumber(ARGV[3]) then
  claimed = ARGV[3]
  catch_up = 1
end
local now = string.format('%d', now_ms)
local previous_owner = state[3]
redis.call('HSET', KEYS[2], 'fence', base)
redis.call('HINCRBY', KEYS[2], 'fence', 1)
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[4])
redis.call('HSET', KEYS[2], 'last_occurrence', claimed, 'owner', ARGV[1], 'modified_at', now)
return {1, redis.call('HGET', KEYS[2], 'fence'), tonumber(claimed), catch_up, previous_owner or false, 0, last or -1, now_ms, 0, repaired}
