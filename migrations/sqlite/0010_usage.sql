-- cronlease schema v10 for sqlite: what a run used (docs/protocol.md, "History"):
-- CPU time in milliseconds and peak memory in bytes, read back from a run's
-- systemd unit (jobs.runner); NULL where the runner could not tell.
ALTER TABLE {prefix}job_runs ADD COLUMN cpu_ms BIGINT NULL;
ALTER TABLE {prefix}job_runs ADD COLUMN memory_peak BIGINT NULL;
