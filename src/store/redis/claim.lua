-- cronlease claim of a batch (see docs/protocol.md): every request decided on
-- its own, in one atomic script on the Redis server's clock.
-- Per request i (from 1): KEYS[2i-1] the lease key (the owner, with a TTL
-- equal to the lease), KEYS[2i] the state hash that never expires (fence,
-- last_occurrence, owner, modified_at, running: "1" from a claim until its
-- run is recorded, "0" after; absent counts as "1"; paused: "1" while the
-- job is paused, written only by pause.lua; trigger: a pending manual run's
-- request id, written by trigger.lua; last_trigger: the one the last manual
-- claim took); ARGV[15(i-1)+1..15]
-- owner, occurrence
-- (ms), previous occurrence (ms) or "", lease (ms), fence floor (decimal u64),
-- "run_once" or "skip", max clock offset (ms: an occurrence later than now +
-- this is refused), "1" when an earlier claim of this occurrence got no answer,
-- "1" for a recheck only (answer that earlier win without extending its
-- lease; refuse anything else, writing nothing), the head start (ms; "" for
-- none): another owner's live lease whose run is over ("0") is taken over
-- once the clock is that far past the occurrence, the id of the manual
-- run's request claimed instead of the occurrence ("" for an occurrence; see
-- manual() below), the job's name, and where the occurrence's window ends
-- (ms; "" for no bound): a claim decided at or after it is stale, refused
-- writing nothing, and "1" for delivery = "at_least_once": the lock's last
-- occurrence equal to the previous one, its run not recorded (running "1")
-- after a scheduled claim (last_trigger's time, its id over 2^20, not after
-- it), no lease and another owner: that occurrence is won again, a catch-up
-- (catch_up 2: redelivered), and the occurrence before the previous one
-- (ms) or "": a win that leaves occurrences nobody claimed (the last one
-- older than the occurrence before the one it runs: this one for a
-- catch-up, else the previous one) takes the fence after next, the one
-- between kept for their record (store::rule::unclaimed, which the Redis
-- store also reads the reply with). The last key, KEYS[2n+1], is the hash
-- of pending requests (job -> id) that nodes poll.
-- Reply: one array per request: {won, fence (decimal string), occurrence,
-- catch_up (1 a missed occurrence, 2 one redelivered), holder_or_previous_owner, remaining_ms, last_occurrence_or_-1,
-- now_ms, too_early, repaired, idle_wait, paused}, too_early 1 when the
-- occurrence is ahead of the clock, 2 when the claim is stale, idle_wait the ms left of an idle
-- holder's head start when that holder kept the claim out (else -1), paused
-- 1 when the claim was refused because the job is paused, 2 when a manual
-- claim's request is no longer pending; won is -1 when the fence is at its maximum
-- (2^63-1): nothing is written for that request; won is -2 when the request
-- failed in the server (a key of the wrong type), with the error as the
-- fifth element: the other requests are decided as usual.
-- Fences are kept exact: Lua numbers are doubles, so they are compared as
-- decimal strings, and from 10^15 on incremented with HINCRBY (64-bit
-- integers); below that a double is exact.
local MAX_FENCE = '9223372036854775807'
local MAX_FENCE_1 = '9223372036854775806'
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
local now = string.format('%d', now_ms)

local function claim(lease_key, state_key, owner, occurrence_s, previous_s, lease_ms, floor_s, misfire, max_offset, unanswered, recheck, head_start, window_end, redeliver, before_previous_s)
  local holder = redis.call('GET', lease_key)
  local remaining = 0
  local repaired = 0
  -- The remaining lease matters only to a claimer it keeps out.
  if holder and holder ~= owner then
    remaining = redis.call('PTTL', lease_key)
    if remaining == -1 and holder ~= owner then
      -- A lease with no expiry (a hand SET or PERSIST) would block the job
      -- forever. Give it one lease from now: a live holder keeps it by
      -- renewing, a dead one loses it then.
      redis.call('PEXPIRE', lease_key, lease_ms)
      remaining = tonumber(lease_ms)
      repaired = 1
    end
    if remaining < 0 then remaining = 0 end
  end
  local state = redis.call('HMGET', state_key, 'fence', 'last_occurrence', 'owner', 'running', 'paused', 'last_trigger')
  local fence = decimal(state[1])
  local last = tonumber(state[2])
  local occurrence = tonumber(occurrence_s)
  local floor = decimal(floor_s)

  -- Our own earlier claim whose answer was lost: the same win, same fence.
  if unanswered == '1' and state[3] == owner and greater(fence, floor) and last
      and (last == occurrence or ((misfire == 'run_once' or redeliver == '1') and previous_s ~= '' and last == tonumber(previous_s))) then
    if recheck ~= '1' then
      redis.call('SET', lease_key, owner, 'PX', lease_ms)
      redis.call('HSET', state_key, 'modified_at', now)
    end
    redis.call('HSET', state_key, 'running', '1')
    local catch_up = 0
    if last ~= occurrence then
      catch_up = 1
      -- Which kind it was is not kept: with at_least_once the run is told
      -- it may be a re-run.
      if redeliver == '1' then catch_up = 2 end
    end
    return {1, fence, last, catch_up, false, 0, last, now_ms, 0, repaired, -1, 0}
  end
  if state[5] == '1' then
    return {0, fence, 0, 0, holder or false, remaining, last or -1, now_ms, 0, repaired, -1, 1}
  end
  -- Decided after the occurrence's window: it waited behind a stall.
  if window_end ~= '' and recheck ~= '1' and now_ms >= tonumber(window_end) then
    return {0, fence, 0, 0, holder or false, remaining, last or -1, now_ms, 2, repaired, -1, 0}
  end
  local claimed_already = last and last >= occurrence
  -- An idle holder keeps an occurrence only for its head start.
  local idle_wait = -1
  local blocks = holder and holder ~= owner
  if blocks and head_start ~= '' and state[4] == '0' and not claimed_already then
    idle_wait = occurrence + tonumber(head_start) - now_ms
    if idle_wait <= 0 then blocks = false end
  end
  if not blocks then idle_wait = -1 end
  if idle_wait < 0 then idle_wait = -1 end
  if blocks or claimed_already or recheck == '1' then
    return {0, fence, 0, 0, holder or false, remaining, last or -1, now_ms, 0, repaired, idle_wait, 0}
  end
  if occurrence > now_ms + (tonumber(max_offset) or 0) then
    return {0, fence, 0, 0, holder or false, remaining, last or -1, now_ms, 1, repaired, -1, 0}
  end
  local base = fence
  if greater(floor, base) then base = floor end

  local claimed = occurrence_s
  local catch_up = 0
  if misfire == 'run_once' and previous_s ~= '' and last and last < tonumber(previous_s) then
    claimed = previous_s
    catch_up = 1
  elseif redeliver == '1' and previous_s ~= '' and last == tonumber(previous_s) and state[4] ~= '0'
      and not holder and state[3] ~= owner
      and not (state[6] and not greater(string.format('%d', (last + 1) * 1048576), decimal(state[6]))) then
    -- The holder of the last occurrence died before recording its run.
    -- A request's claim set the mark when the last request taken carries
    -- a time after that occurrence: its id is at least (last + 1) * 2^20.
    claimed = previous_s
    catch_up = 2
  end
  -- Occurrences nobody claimed: the fence between is theirs.
  local before = previous_s
  if catch_up == 1 then before = before_previous_s end
  local step = 1
  if catch_up ~= 2 and last and before ~= '' and last < tonumber(before) then step = 2 end
  local limit = MAX_FENCE
  if step == 2 then limit = MAX_FENCE_1 end
  if not greater(limit, base) then
    return {-1, fence, 0, 0, holder or false, remaining, last or -1, now_ms, 0, repaired, -1, 0}
  end
  local previous_owner = state[3]
  local new_fence
  redis.call('SET', lease_key, owner, 'PX', lease_ms)
  if #base <= 15 then
    -- Below 10^15 a double is exact: one write for the whole row.
    new_fence = string.format('%d', tonumber(base) + step)
    redis.call('HSET', state_key, 'fence', new_fence, 'last_occurrence', claimed, 'owner', owner, 'modified_at', now, 'running', '1')
  else
    redis.call('HSET', state_key, 'fence', base)
    redis.call('HINCRBY', state_key, 'fence', step)
    -- Read back as a string: the integer reply would become a double.
    new_fence = redis.call('HGET', state_key, 'fence')
    redis.call('HSET', state_key, 'last_occurrence', claimed, 'owner', owner, 'modified_at', now, 'running', '1')
  end
  return {1, new_fence, tonumber(claimed), catch_up, previous_owner or false, 0, last or -1, now_ms, 0, repaired, -1, 0}
end

-- A manual run (docs/protocol.md, "Manual runs"): won iff request `id` is
-- still the job's pending one and no run is in progress (a live lease whose
-- run is not recorded); takes the lease, with a fence of its own, sets the
-- running mark and clears the request. The last occurrence stays.
local function manual(lease_key, state_key, owner, id, lease_ms, floor_s, unanswered, recheck, job)
  local triggers = KEYS[#KEYS]
  local holder = redis.call('GET', lease_key)
  local remaining = 0
  if holder then
    remaining = redis.call('PTTL', lease_key)
    if remaining < 0 then remaining = 0 end
  end
  local state = redis.call('HMGET', state_key, 'fence', 'last_occurrence', 'owner', 'running', 'trigger', 'last_trigger')
  local fence = decimal(state[1])
  local last = tonumber(state[2])
  local floor = decimal(floor_s)
  if unanswered == '1' and state[3] == owner and greater(fence, floor) and state[6] == id then
    if recheck ~= '1' then
      redis.call('SET', lease_key, owner, 'PX', lease_ms)
      redis.call('HSET', state_key, 'modified_at', now)
    end
    return {1, fence, now_ms, 0, false, 0, last or -1, now_ms, 0, 0, -1, 0}
  end
  if state[5] ~= id then
    -- Taken or never recorded: an announcement left behind goes.
    if redis.call('HGET', triggers, job) == id then redis.call('HDEL', triggers, job) end
    return {0, fence, 0, 0, holder or false, remaining, last or -1, now_ms, 0, 0, -1, 2}
  end
  if recheck == '1' or (holder and state[4] ~= '0') then
    return {0, fence, 0, 0, holder or false, remaining, last or -1, now_ms, 0, 0, -1, 0}
  end
  local base = fence
  if greater(floor, base) then base = floor end
  if not greater(MAX_FENCE, base) then
    return {-1, fence, 0, 0, holder or false, remaining, last or -1, now_ms, 0, 0, -1, 0}
  end
  local new_fence
  redis.call('SET', lease_key, owner, 'PX', lease_ms)
  if #base <= 15 then
    new_fence = string.format('%d', tonumber(base) + 1)
    redis.call('HSET', state_key, 'fence', new_fence)
  else
    redis.call('HSET', state_key, 'fence', base)
    redis.call('HINCRBY', state_key, 'fence', 1)
    new_fence = redis.call('HGET', state_key, 'fence')
  end
  redis.call('HSET', state_key, 'owner', owner, 'modified_at', now, 'running', '1', 'last_trigger', id)
  redis.call('HDEL', state_key, 'trigger')
  if redis.call('HGET', triggers, job) == id then redis.call('HDEL', triggers, job) end
  return {1, new_fence, now_ms, 0, state[3] or false, 0, last or -1, now_ms, 0, 0, -1, 0}
end

local replies = {}
for i = 1, (#KEYS - 1) / 2 do
  local a = 15 * (i - 1)
  local ok, reply
  if ARGV[a + 11] ~= '' then
    ok, reply = pcall(manual, KEYS[2 * i - 1], KEYS[2 * i], ARGV[a + 1], ARGV[a + 11], ARGV[a + 4],
      ARGV[a + 5], ARGV[a + 8], ARGV[a + 9], ARGV[a + 12])
  else
    ok, reply = pcall(claim, KEYS[2 * i - 1], KEYS[2 * i], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3],
      ARGV[a + 4], ARGV[a + 5], ARGV[a + 6], ARGV[a + 7], ARGV[a + 8], ARGV[a + 9], ARGV[a + 10],
      ARGV[a + 13], ARGV[a + 14], ARGV[a + 15])
  end
  if ok then
    replies[i] = reply
  else
    local e = reply
    if type(e) == 'table' then e = e.err or 'error' end
    replies[i] = {-2, '0', 0, 0, tostring(e), 0, -1, now_ms, 0, 0, -1, 0}
  end
end
return replies
