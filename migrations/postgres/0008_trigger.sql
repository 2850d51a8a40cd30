-- cronlease schema v8 for postgres: manual runs (`cronlease trigger`, docs/protocol.md,
-- "Manual runs"). trigger_id: the request pending on the job's lock (NULL
-- when none), set by `trigger` and cleared by the claim that takes it;
-- last_trigger: the request the last manual claim took. The index keeps
-- the nodes' frequent look for pending requests cheap. A run's history
-- row names the request it ran for (NULL for a scheduled occurrence).
ALTER TABLE {prefix}lock_info ADD COLUMN IF NOT EXISTS trigger_id BIGINT NULL;
ALTER TABLE {prefix}lock_info ADD COLUMN IF NOT EXISTS last_trigger BIGINT NULL;
ALTER TABLE {prefix}job_runs ADD COLUMN IF NOT EXISTS trigger_id BIGINT NULL;
CREATE INDEX IF NOT EXISTS {prefix}lock_info_trigger ON {prefix}lock_info (trigger_id) WHERE trigger_id IS NOT NULL;
