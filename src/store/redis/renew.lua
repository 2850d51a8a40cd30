-- Extends a live lease, only for its owner. KEYS[1] lease key; ARGV[1] owner, ARGV[2] lease (ms).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
