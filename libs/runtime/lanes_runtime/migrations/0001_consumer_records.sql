-- What each durable consumer has processed, written in the same transaction as the consumer's effects,
-- so a redelivered event that is already recorded is acknowledged and skipped.
CREATE TABLE lanes_processed (
    consumer     text        NOT NULL,
    event_id     text        NOT NULL,
    stream       text        NOT NULL,
    stream_seq   bigint      NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

-- Events a handler decided to publish, stored with its effects and published after commit.
-- A crash between commit and publish leaves the rows here; the redelivered cause publishes them again
-- (same Nats-Msg-Id, so JetStream keeps one copy).
CREATE TABLE lanes_outbox (
    id         bigserial   PRIMARY KEY,
    consumer   text        NOT NULL,
    cause_id   text        NOT NULL,
    subject    text        NOT NULL,
    stream     text        NOT NULL,
    headers    jsonb       NOT NULL,
    payload    bytea       NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX lanes_outbox_by_cause ON lanes_outbox (consumer, cause_id, id);
