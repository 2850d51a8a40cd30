-- cronlease schema v11 for mysql: the outbox (docs/protocol.md, "Webhook
-- deliveries handed over"). One row per parcel a node handed over for a
-- peer to finish (a webhook delivery a stopping daemon did not make);
-- a peer takes one by deleting its row. handed_at: store clock, ms.
CREATE TABLE IF NOT EXISTS {prefix}outbox (
    id        VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,
    body      MEDIUMTEXT NOT NULL,
    handed_at BIGINT NOT NULL
);
