-- cronlease schema v11 for postgres: the outbox (docs/protocol.md, "Webhook
-- deliveries handed over"). One row per parcel a node handed over for a
-- peer to finish (a webhook delivery a stopping daemon did not make);
-- a peer takes one by deleting its row. handed_at: store clock, ms.
CREATE TABLE IF NOT EXISTS {prefix}outbox (
    id        VARCHAR(255) NOT NULL PRIMARY KEY,
    body      TEXT NOT NULL,
    handed_at BIGINT NOT NULL
);
