-- cronlease schema v6 for postgres: the pause mark (docs/protocol.md, "Pause").
-- 1 while the job is paused by `cronlease pause`: every claim is refused.
-- Set and cleared only by pause and resume; a claim never writes it.
ALTER TABLE {prefix}lock_info ADD COLUMN IF NOT EXISTS paused BIGINT NOT NULL DEFAULT 0;
