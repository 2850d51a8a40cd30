-- cronlease trigger (docs/protocol.md, "Manual runs"): records a manual
-- run's request with the job's state, refused while a run of the job is in
-- progress (a live lease whose run is not recorded: running "1" or absent)
-- or another request is pending. The request is also named in the hash of
-- pending requests (job -> id) that nodes poll, and published on the
-- channel of that hash's name so nodes look at once; the claim that takes
-- it (claim.lua) clears both. A PUBLISH the server refuses (an ACL without
-- the channel) leaves the request standing: the nodes' beats find it.
-- KEYS[1] the job's lease key, KEYS[2] its state hash, KEYS[3] the hash of
-- pending requests. ARGV[1] the request id, ARGV[2] the job.
-- Reply: {0, "", false} accepted; {1, "", holder} a run in progress;
-- {2, pending id, false} another request pending.
local pending = redis.call('HGET', KEYS[2], 'trigger')
if pending then return {2, pending, false} end
local holder = redis.call('GET', KEYS[1])
if holder and redis.call('HGET', KEYS[2], 'running') ~= '0' then
  return {1, '', holder}
end
redis.call('HSET', KEYS[2], 'trigger', ARGV[1])
redis.call('HSET', KEYS[3], ARGV[2], ARGV[1])
redis.pcall('PUBLISH', KEYS[3], ARGV[2])
return {0, '', false}
