-- cronlease schema v4 for sqlite: the node registry. One row per owner (a
-- daemon's incarnation), refreshed by its heartbeats; a row whose
-- expires_at (store clock, ms) has passed is a dead node, listed by no one
-- and deleted by a later heartbeat.
CREATE TABLE IF NOT EXISTS {prefix}nodes (
    owner           VARCHAR(255) NOT NULL PRIMARY KEY,
    node            VARCHAR(255) NOT NULL,
    version         VARCHAR(64)  NOT NULL,
    started_at      BIGINT       NOT NULL,
    last_seen       BIGINT       NOT NULL,
    expires_at      BIGINT       NOT NULL,
    clock_offset_ms BIGINT       NULL,
    jobs_held       BIGINT       NOT NULL DEFAULT 0
);
