-- cronlease schema v1 for PostgreSQL. `{prefix}` is store.table_prefix.
-- Instants are milliseconds since the Unix epoch (UTC): expires_at and
-- modified_at on the store's clock, last_occurrence the scheduled instant.
CREATE TABLE IF NOT EXISTS {prefix}lock_info (
    lock_name       VARCHAR(128) NOT NULL PRIMARY KEY,
    owner           VARCHAR(255) NULL,
    fence           BIGINT       NOT NULL DEFAULT 0,
    expires_at      BIGINT       NOT NULL DEFAULT 0,
    last_occurrence BIGINT       NULL,
    modified_at     BIGINT       NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS {prefix}job_runs (
    id          BIGSERIAL    PRIMARY KEY,
    job         VARCHAR(128) NOT NULL,
    fence       BIGINT       NOT NULL,
    owner       VARCHAR(255) NOT NULL,
    node        VARCHAR(255) NOT NULL,
    occurrence  BIGINT       NOT NULL,
    started_at  BIGINT       NOT NULL,
    finished_at BIGINT       NOT NULL,
    outcome     VARCHAR(16)  NOT NULL,
    exit_code   BIGINT       NULL,
    takeover    BIGINT       NOT NULL DEFAULT 0,
    delay_ms    BIGINT       NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS {prefix}job_runs_job ON {prefix}job_runs (job, id);
