-- cronlease schema v15 for sqlite: each node's registry row says how far its
-- claims have gone (docs/protocol.md, "Followers leave held jobs to their
-- holder"): every occurrence up to claimed_through (ms) it claimed has its
-- answer, and releases counts the leases it gave up while alive. NULL for a
-- node of an earlier version (followers then claim its jobs as before).
-- Additive: binaries that know schema 14 claim on it.
ALTER TABLE {prefix}nodes ADD COLUMN claimed_through BIGINT NULL;
ALTER TABLE {prefix}nodes ADD COLUMN releases BIGINT NULL;
