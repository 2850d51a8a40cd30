-- Redlock, phase 1 on one master (docs/protocol.md): per request, take the
-- job's lease key where it is free (SET NX PX) and report the job's state as
-- this master has it. Besides leases, only the state's `claiming` is
-- written here: whether a claim is won is decided by the node over a
-- majority of masters, never by one master.
-- An idle holder keeps an occurrence only for its head start (fast
-- takeover, docs/protocol.md): where the state's running mark is "0" (the
-- run of the holder's last claim is recorded here) and the occurrence is
-- unclaimed here, its lease is taken over once this master's clock is the
-- head start past the occurrence, and before that the rest is reported.
-- A claim that has the lease here notes its occurrence (the state's
-- `claiming`): a holder whose claim is under way on this master, slower
-- than the head start, is not taken over here between its two phases
-- (which could leave the occurrence to nobody).
-- Per request i (from 1): KEYS[2i-1] the lease key, KEYS[2i] the state hash
-- (fence, last_occurrence, owner, running, claiming); ARGV[5i-4] the
-- owner, ARGV[5i-3] the lease (ms), or "0" to take nothing (a recheck only
-- reads), ARGV[5i-2] the occurrence (ms), ARGV[5i-1] the head start (ms; ""
-- for none), ARGV[5i] "1" for a manual run's claim.
-- Reply: {now_ms, {{got, holder, pttl, fence, last, state_owner, idle_wait,
-- paused, pause_gen, trigger, last_trigger, running}, ...}}: got 2 the lease was the owner's already (3: and its
-- run is not recorded, for a manual claim), 1 taken now, 0 held by
-- another (holder, pttl) or free and not taken (a recheck), -2 the request
-- failed in the server (holder = the error). fence is a decimal string,
-- last -1 when none, holder and state_owner false when none, idle_wait the
-- ms left of an idle holder's head start (-1 when the rule does not apply),
-- paused 1 when the state's pause mark is set (pause.lua), pause_gen the
-- generation it was written with (0 when none): the node keeps the mark
-- of the highest generation, like the fence, and refuses a paused claim;
-- trigger the manual run's request pending here and last_trigger the one
-- the last manual claim took here (false when none), running 1 while the
-- state's running mark is set (absent counts as set), else 0. A manual claim takes
-- a free lease, or an idle holder's at once (no head start, no clock
-- compared), and is kept out by a busy one, its own owner's included.
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function take(lease_key, state_key, owner, lease_ms, occurrence, head_start, manual)
  local state = redis.call('HMGET', state_key, 'fence', 'last_occurrence', 'owner', 'running', 'claiming', 'paused', 'pause_gen', 'trigger', 'last_trigger')
  local trig, last_trig = state[8] or false, state[9] or false
  -- The running mark (absent counts as set).
  local running = 1
  if state[4] == '0' then running = 0 end
  local paused = 0
  if state[6] == '1' then paused = 1 end
  local pause_gen = tonumber(state[7]) or 0
  local fence = state[1] or '0'
  local last = tonumber(state[2]) or -1
  local occ = tonumber(occurrence)
  -- The lease becomes the owner's here, noting the occurrence it claims.
  local function take_now()
    redis.call('SET', lease_key, owner, 'PX', lease_ms)
    redis.call('HSET', state_key, 'claiming', occurrence)
    return {1, owner, tonumber(lease_ms), fence, last, state[3] or false, -1, paused, pause_gen, trig, last_trig, running}
  end
  local holder = redis.call('GET', lease_key)
  if manual == '1' and holder then
    -- A state without the running mark counts busy. The owner's own busy
    -- lease answers 3: the node refuses the claim unless it is the retry
    -- of an earlier manual win (whose run set the mark).
    local busy = state[4] ~= '0'
    if holder == owner then
      local got = 2
      if busy then got = 3 end
      return {got, holder, redis.call('PTTL', lease_key), fence, last, state[3] or false, -1, paused, pause_gen, trig, last_trig, running}
    end
    if busy or lease_ms == '0' then
      return {0, holder, redis.call('PTTL', lease_key), fence, last, state[3] or false, -1, paused, pause_gen, trig, last_trig, running}
    end
    return take_now()
  end
  if holder == owner then
    if lease_ms ~= '0' then
      redis.call('HSET', state_key, 'claiming', occurrence)
    end
    return {2, holder, redis.call('PTTL', lease_key), fence, last, state[3] or false, -1, paused, pause_gen, trig, last_trig, running}
  end
  if holder then
    local pttl = redis.call('PTTL', lease_key)
    if pttl == -1 and lease_ms ~= '0' then
      -- A lease with no expiry (a hand SET or PERSIST) would block the job
      -- forever: give it one lease from now.
      redis.call('PEXPIRE', lease_key, lease_ms)
      pttl = tonumber(lease_ms)
    end
    -- A state without the mark (written before it existed) counts busy.
    if head_start ~= '' and state[4] == '0' and last < occ and (tonumber(state[5]) or -1) < occ then
      local wait = occ + tonumber(head_start) - now_ms
      if wait > 0 or lease_ms == '0' then
        return {0, holder, pttl, fence, last, state[3] or false, math.max(wait, 0), paused, pause_gen, trig, last_trig, running}
      end
      return take_now()
    end
    return {0, holder, pttl, fence, last, state[3] or false, -1, paused, pause_gen, trig, last_trig, running}
  end
  if lease_ms == '0' then
    return {0, false, 0, fence, last, state[3] or false, -1, paused, pause_gen, trig, last_trig, running}
  end
  return take_now()
end

local replies = {}
for i = 1, #KEYS / 2 do
  local a = 5 * (i - 1)
  local ok, reply = pcall(take, KEYS[2 * i - 1], KEYS[2 * i], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], ARGV[a + 5])
  if ok then
    replies[i] = reply
  else
    local e = reply
    if type(e) == 'table' then e = e.err or 'error' end
    replies[i] = {-2, tostring(e), 0, '0', -1, false, -1, 0, 0, false, false, 1}
  end
end
return {now_ms, replies}
