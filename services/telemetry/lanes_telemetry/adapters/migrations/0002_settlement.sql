-- Each rank's process as the lifecycle reports it (rank_started, rank_exited): its pid matches kernel lines
-- that name one; its exit (code or signal, and how many evidence items its agent sent) settles the finding.
CREATE TABLE telemetry_processes (
    job_id         text        NOT NULL,
    attempt        integer     NOT NULL,
    rank           integer     NOT NULL,
    node           text,
    pid            integer,
    exit_code      integer,
    signal         integer,
    evidence_count integer,
    exited         boolean     NOT NULL DEFAULT false,
    exited_at      timestamptz,
    exit_event_id  text,
    PRIMARY KEY (job_id, attempt, rank)
);
CREATE INDEX telemetry_processes_by_pid ON telemetry_processes (node, pid) WHERE pid IS NOT NULL;

-- Failed attempts and their settle window: the timer publishes settle_window_ended once `settle_due_at`
-- passed, and the consumer that handles it sets `window_ended` (so a restart loses no timer).
CREATE TABLE telemetry_attempts (
    job_id        text        NOT NULL,
    attempt       integer     NOT NULL,
    ended_at      timestamptz NOT NULL,
    settle_due_at timestamptz NOT NULL,
    window_s      double precision NOT NULL,
    window_ended  boolean     NOT NULL DEFAULT false,
    PRIMARY KEY (job_id, attempt)
);
CREATE INDEX telemetry_attempts_due ON telemetry_attempts (settle_due_at) WHERE NOT window_ended;

-- Node-level evidence that names no pid, on a node several attempts shared when it happened: filed under
-- each of them (their timelines show it, labelled shared), and never any one's first error on its own.
CREATE TABLE telemetry_shared_evidence (
    event_id text    NOT NULL,
    job_id   text    NOT NULL,
    attempt  integer NOT NULL,
    PRIMARY KEY (event_id, job_id, attempt)
);
