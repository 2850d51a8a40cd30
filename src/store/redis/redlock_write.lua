-- Redlock, phase 2 on one master (docs/protocol.md): per claim the node won
-- on a majority of leases, write its fence and occurrence, only where the
-- lease is still the owner's, and extend that lease to its full length.
-- The state's running mark is set: the holder keeps its whole lease until
-- the run of this claim is recorded (record.lua clears it).
-- Per request i: KEYS[2i-1] the lease key, KEYS[2i] the state hash;
-- ARGV[6(i-1)+1..6] owner, lease (ms), fence (decimal), last occurrence (ms;
-- "" to leave it), the manual run's request id ("" for an occurrence) and
-- the job. A manual claim keeps the last occurrence, notes its request as
-- the last one taken and clears the pending one, here and in the hash of
-- pending requests, KEYS[#KEYS].
-- A fence lower than the one stored is not written (a master that missed
-- phase 1's read may know a newer claim): that master does not count.
-- Reply: per request 1 written, 0 not (the lease is not the owner's here,
-- or the stored fence is higher).
local function greater(a, b)
  if #a ~= #b then return #a > #b end
  return a > b
end
local t = redis.call('TIME')
local now = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
local done = {}
for i = 1, (#KEYS - 1) / 2 do
  local a = 6 * (i - 1)
  local lease_key, state_key = KEYS[2 * i - 1], KEYS[2 * i]
  local owner, fence = ARGV[a + 1], ARGV[a + 3]
  done[i] = 0
  if redis.call('GET', lease_key) == owner then
    local stored = redis.call('HGET', state_key, 'fence') or '0'
    if not greater(stored, fence) then
      redis.call('PEXPIRE', lease_key, ARGV[a + 2])
      redis.call('HSET', state_key, 'fence', fence, 'owner', owner, 'modified_at', now, 'running', '1')
      if ARGV[a + 4] ~= '' then
        redis.call('HSET', state_key, 'last_occurrence', ARGV[a + 4])
      end
      local id = ARGV[a + 5]
      if id ~= '' then
        redis.call('HSET', state_key, 'last_trigger', id)
        redis.call('HDEL', state_key, 'trigger')
        if redis.call('HGET', KEYS[#KEYS], ARGV[a + 6]) == id then
          redis.call('HDEL', KEYS[#KEYS], ARGV[a + 6])
        end
      end
      done[i] = 1
    end
  end
end
return done
