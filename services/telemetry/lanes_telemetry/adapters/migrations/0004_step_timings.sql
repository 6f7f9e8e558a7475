-- Each rank's time per training step (from the heartbeats its agent batches), read for slow ranks and
-- degraded links, and the one slowdown reported per attempt.
CREATE TABLE telemetry_step_timings (
    job_id    text             NOT NULL,
    attempt   integer          NOT NULL,
    rank      integer          NOT NULL,
    step      integer          NOT NULL,
    node      text             NOT NULL,
    compute_s double precision NOT NULL,
    wait_s    double precision NOT NULL,
    PRIMARY KEY (job_id, attempt, step, rank)
);

CREATE TABLE telemetry_slowdowns (
    job_id   text    NOT NULL,
    attempt  integer NOT NULL,
    kind     text    NOT NULL,
    data     jsonb   NOT NULL,
    PRIMARY KEY (job_id, attempt)
);
