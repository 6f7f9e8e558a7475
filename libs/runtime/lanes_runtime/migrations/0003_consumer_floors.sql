-- The ack floor each durable consumer last reported (lanes_runtime.upkeep): every message of the stream at
-- or below it was committed and acknowledged. A durable that disappears (or is bent by someone else) is
-- recreated to start right after it, so nothing after it is lost and nothing far below it comes back.
-- stream_created names the stream the floor belongs to: a stream deleted and made again restarts its
-- sequences, and a floor of the old one must not skip the new one's first messages.
CREATE TABLE lanes_consumer_floors (
    consumer       text        PRIMARY KEY,
    stream         text        NOT NULL,
    stream_created timestamptz,
    ack_floor      bigint      NOT NULL,
    recorded_at    timestamptz NOT NULL DEFAULT now()
);
