-- cronlease schema v13 for postgres: the audit (docs/protocol.md, "Audit").
-- One row per operator action on a job (pause, resume, trigger, withdraw,
-- cancel): who, why and what it did, as JSON in body. id: the store clock in
-- ms (13 digits), '-', 8 random hex digits; unique and in time order. The
-- newest store.history_limit rows per job are kept. Additive: binaries that
-- know schema 12 claim on it.
CREATE TABLE IF NOT EXISTS {prefix}audit (
    id   VARCHAR(32)  NOT NULL,
    job  VARCHAR(128) NOT NULL,
    body TEXT         NOT NULL,
    PRIMARY KEY (job, id)
);
-- The newest entries of every job (status, history of all jobs), by id.
CREATE INDEX IF NOT EXISTS {prefix}audit_id ON {prefix}audit (id);
