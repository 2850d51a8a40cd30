-- cronlease trigger on Redlock: a request that a majority of masters did
-- not take is withdrawn from those that did (trigger.lua), so it blocks no
-- later request there. KEYS[1] the job's state hash, KEYS[2] the hash of
-- pending requests; ARGV[1] the request id, ARGV[2] the job.
-- Reply: 1 withdrawn here, 0 not pending here.
if redis.call('HGET', KEYS[1], 'trigger') ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[1], 'trigger')
if redis.call('HGET', KEYS[2], ARGV[2]) == ARGV[1] then
  redis.call('HDEL', KEYS[2], ARGV[2])
end
return 1
