-- cronlease schema v12 for postgres: each node's registry row carries the runs
-- going on it as its last beat said (docs/protocol.md, "Running now"), as
-- JSON. NULL for a node of an earlier version. Additive: binaries that know
-- schema 11 claim on it.
ALTER TABLE {prefix}nodes ADD COLUMN IF NOT EXISTS running_runs TEXT NULL;
