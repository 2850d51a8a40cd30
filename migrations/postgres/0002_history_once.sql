-- cronlease schema v2 for PostgreSQL: a run is recorded once per (job, fence).
-- History also keeps decision_ms: from the scheduled instant to the claim's answer.
-- Duplicates an older version wrote (a history write retried after a timeout
-- that had committed) are removed first, keeping the first record.
DELETE FROM {prefix}job_runs a USING {prefix}job_runs b WHERE a.job = b.job AND a.fence = b.fence AND a.id > b.id;
CREATE UNIQUE INDEX IF NOT EXISTS {prefix}job_runs_fence ON {prefix}job_runs (job, fence);
ALTER TABLE {prefix}job_runs ADD COLUMN IF NOT EXISTS decision_ms BIGINT NOT NULL DEFAULT 0;
