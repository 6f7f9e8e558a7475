-- Pruning finds old processed records by time; the primary key serves the duplicate checks.
CREATE INDEX lanes_processed_by_age ON lanes_processed (consumer, processed_at);

-- Per-key ordered consumers (ConsumerSpec.ordered) stage each fetched event here in the transaction that
-- records it, and acknowledge it; a fold step then applies the staged events at or below the consumer's
-- ack floor in stream order. Everything below the ack floor was acknowledged, so it is here (or was
-- dead-lettered): a fold never skips an earlier event of a key, across crashes and replicas.
CREATE TABLE lanes_inbox (
    consumer   text        NOT NULL,
    stream_seq bigint      NOT NULL,
    event_id   text        NOT NULL,
    subject    text        NOT NULL,
    headers    jsonb       NOT NULL,
    payload    bytea       NOT NULL,
    attempts   integer     NOT NULL DEFAULT 0,
    staged_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, stream_seq)
);
