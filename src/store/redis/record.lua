-- Records finished runs, once per (job, fence), in one step.
-- Per run i: KEYS[3i-2] the job's run stream, KEYS[3i-1] the sorted set of
-- its recorded fences, KEYS[3i] its state hash. ARGV[1] runs kept per job;
-- then per run: the fence (decimal), "1" when the run ends its claim's
-- running mark ("0" for a skipped occurrence), the number n of stream
-- fields and values, and those n strings.
-- A fence recorded already is skipped, so a write retried after a timeout
-- that did commit leaves one entry. The state's running mark is cleared
-- only while the state's fence is the run's (a newer claim has its own).
-- Reply: how many runs were added.
local keep = tonumber(ARGV[1])
local a = 2
local added = 0
for i = 1, #KEYS / 3 do
  local stream, fences, state = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local fence = ARGV[a]
  local ends = ARGV[a + 1]
  local n = tonumber(ARGV[a + 2])
  local fields = {}
  for j = 1, n do fields[j] = ARGV[a + 2 + j] end
  a = a + 3 + n
  if not redis.call('ZSCORE', fences, fence) then
    -- The entry first: a fence is marked recorded only once it is.
    redis.call('XADD', stream, 'MAXLEN', keep, '*', unpack(fields))
    redis.call('ZADD', fences, fence, fence)
    redis.call('ZREMRANGEBYRANK', fences, 0, -(keep + 1))
    added = added + 1
  end
  if ends == '1' and redis.call('HGET', state, 'fence') == fence then
    redis.call('HSET', state, 'running', '0')
  end
end
return added
