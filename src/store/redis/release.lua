-- Ends a live lease, only for its owner; fence and last occurrence stay.
-- KEYS[1] lease key; ARGV[1] owner.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
