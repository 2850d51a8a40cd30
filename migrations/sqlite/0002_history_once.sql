-- cronlease schema v2 for SQLite: a run is recorded once per (job, fence).
-- History also keeps decision_ms: from the scheduled instant to the claim's answer.
-- Duplicates an older version wrote (a history write retried after a timeout
-- that had committed) are removed first, keeping the first record.
DELETE FROM {prefix}job_runs WHERE id NOT IN (SELECT MIN(id) FROM {prefix}job_runs GROUP BY job, fence);
CREATE UNIQUE INDEX IF NOT EXISTS {prefix}job_runs_fence ON {prefix}job_runs (job, fence);
ALTER TABLE {prefix}job_runs ADD COLUMN decision_ms INTEGER NOT NULL DEFAULT 0;
