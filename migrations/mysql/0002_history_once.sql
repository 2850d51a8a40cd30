-- cronlease schema v2 for MySQL / MariaDB: a run is recorded once per (job, fence).
-- History also keeps decision_ms: from the scheduled instant to the claim's answer.
-- Duplicates an older version wrote (a history write retried after a timeout
-- that had committed) are removed first, keeping the first record.
-- (An index or column that exists already, after tables were re-created, is skipped.)
DELETE r FROM {prefix}job_runs r JOIN {prefix}job_runs k ON k.job = r.job AND k.fence = r.fence AND k.id < r.id;
CREATE UNIQUE INDEX {prefix}job_runs_fence ON {prefix}job_runs (job, fence);
ALTER TABLE {prefix}job_runs ADD COLUMN decision_ms BIGINT NOT NULL DEFAULT 0;
