-- cronlease schema v9 for postgres: each node's registry row carries what its
-- last beat said of its job definitions (docs/protocol.md, "Job definitions
-- across nodes"), as JSON. NULL for a node of an earlier version. Additive:
-- binaries that know schema 8 claim on it.
ALTER TABLE {prefix}nodes ADD COLUMN IF NOT EXISTS definitions TEXT NULL;
