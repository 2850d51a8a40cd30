-- Extends live leases, only for their owner, in one step.
-- KEYS: lease keys; ARGV[1] owner, ARGV[1+i] the lease (ms) for KEYS[i].
-- Reply: per key, 1 if extended, 0 if the lease is not the owner's (or gone).
local done = {}
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    redis.call('PEXPIRE', key, ARGV[1 + i])
    done[i] = 1
  else
    done[i] = 0
  end
end
return done
