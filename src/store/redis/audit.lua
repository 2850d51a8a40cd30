-- Records one audit entry (docs/protocol.md, "Audit") in the job's sorted
-- set and trims it, in one step. KEYS[1] the job's audit; ARGV[1] entries
-- kept per job, ARGV[2] the entry's time (ms, its score), ARGV[3] the
-- member: the entry's id, a space, its JSON. The same entry written again
-- is the same member: one entry. Reply: the entries kept.
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -(tonumber(ARGV[1]) + 1))
return redis.call('ZCARD', KEYS[1])
