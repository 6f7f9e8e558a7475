-- How far each attempt's step timings have been read for a slowdown: the reader goes on from there, block by
-- block, so what it finds depends on the timings alone, never on how heartbeats happened to be batched.
CREATE TABLE telemetry_slowdown_reads (
    job_id       text    NOT NULL,
    attempt      integer NOT NULL,
    read_through integer NOT NULL,
    PRIMARY KEY (job_id, attempt)
);
