-- cronlease schema v14 for mysql: each node's registry row carries the node's
-- tags (docs/configuration.md, "Node tags") as a JSON list. NULL for a node
-- of an earlier version (no tags). Additive: binaries that know schema 13
-- claim on it.
ALTER TABLE {prefix}nodes ADD COLUMN tags TEXT NULL;
