-- cronlease schema v7 for mysql: the output tail of a run (docs/protocol.md, "History").
-- The last `output_tail` bytes of the run's stdout and stderr as UTF-8 text,
-- the store's password removed; NULL when none was kept.
ALTER TABLE {prefix}job_runs ADD COLUMN output MEDIUMTEXT NULL;
