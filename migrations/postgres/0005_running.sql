-- cronlease schema v5 for postgres: the running mark (docs/protocol.md, "Fast
-- takeover"). 1 while the run of the lock's last claim is not recorded:
-- set by every claim, cleared by the history write of that claim's run.
-- Rows from before start at 1 (unknown: the holder keeps its whole lease),
-- so a node of an older version, which never clears it, is never taken
-- over early.
ALTER TABLE {prefix}lock_info ADD COLUMN IF NOT EXISTS running BIGINT NOT NULL DEFAULT 1;
