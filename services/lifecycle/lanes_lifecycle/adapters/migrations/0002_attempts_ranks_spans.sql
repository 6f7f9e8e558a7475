-- Jobs with attempts: queryable rows for attempts, rank processes and time in each state, next to the
-- folded view (which stays the one thing the fold reads back). `transition_seq` is the JetStream sequence
-- of the job's last published state change: the expected sequence of its next one.
ALTER TABLE lifecycle_jobs ADD COLUMN transition_seq bigint NOT NULL DEFAULT 0;
ALTER TABLE lifecycle_jobs ADD COLUMN flags text[] NOT NULL DEFAULT '{}';

CREATE TABLE lifecycle_attempts (
    job_id               text        NOT NULL REFERENCES lifecycle_jobs (job_id),
    attempt              integer     NOT NULL,
    state                text        NOT NULL,
    nodes                text[]      NOT NULL,
    requested_at         timestamptz,
    started_at           timestamptz,
    ended_at             timestamptz,
    cause                text,
    cause_detail         text,
    last_checkpoint_step bigint,
    lost_steps           bigint,
    released             boolean     NOT NULL,
    PRIMARY KEY (job_id, attempt)
);

CREATE TABLE lifecycle_ranks (
    job_id    text    NOT NULL,
    attempt   integer NOT NULL,
    rank      integer NOT NULL,
    node      text    NOT NULL,
    state     text    NOT NULL,
    pid       integer,
    exit_code integer,
    signal    integer,
    PRIMARY KEY (job_id, attempt, rank),
    FOREIGN KEY (job_id, attempt) REFERENCES lifecycle_attempts (job_id, attempt)
);

CREATE TABLE lifecycle_state_spans (
    job_id     text        NOT NULL REFERENCES lifecycle_jobs (job_id),
    position   integer     NOT NULL,
    state      text        NOT NULL,
    attempt    integer     NOT NULL,
    entered_at timestamptz NOT NULL,
    left_at    timestamptz,
    cause_type text        NOT NULL,
    cause_id   text        NOT NULL,
    reason     text        NOT NULL,
    PRIMARY KEY (job_id, position)
);
