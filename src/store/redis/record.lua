-- Records finished runs, once per (job, fence), in one step.
-- Per run i: KEYS[2i-1] the job's run stream, KEYS[2i] the sorted set of its
-- recorded fences. ARGV[1] runs kept per job; then per run: the fence
-- (decimal), the number n of stream fields and values, and those n strings.
-- A fence recorded already is skipped, so a write retried after a timeout
-- that did commit leaves one entry. Reply: how many runs were added.
local keep = tonumber(ARGV[1])
local a = 2
local added = 0
for i = 1, #KEYS / 2 do
  local stream, fences = KEYS[2 * i - 1], KEYS[2 * i]
  local fence = ARGV[a]
  local n = tonumber(ARGV[a + 1])
  local fields = {}
  for j = 1, n do fields[j] = ARGV[a + 1 + j] end
  a = a + 2 + n
  if not redis.call('ZSCORE', fences, fence) then
    -- The entry first: a fence is marked recorded only once it is.
    redis.call('XADD', stream, 'MAXLEN', keep, '*', unpack(fields))
    redis.call('ZADD', fences, fence, fence)
    redis.call('ZREMRANGEBYRANK', fences, 0, -(keep + 1))
    added = added + 1
  end
end
return added
