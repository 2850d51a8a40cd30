-- Ends live leases, only for their owner; fence and last occurrence stay.
-- KEYS: lease keys; ARGV[1] owner. Reply: how many leases ended.
local n = 0
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    redis.call('DEL', key)
    n = n + 1
  end
end
return n
