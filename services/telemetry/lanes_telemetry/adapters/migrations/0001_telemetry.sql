-- Where each rank of each attempt was placed, read from the job stream (lanes.job.*.placed) by
-- telemetry's own consumer: correlation needs it and services never read each other's tables.
CREATE TABLE telemetry_placements (
    job_id      text        NOT NULL,
    attempt     integer     NOT NULL,
    rank        integer     NOT NULL,
    node        text        NOT NULL,
    gpus        integer[]   NOT NULL,
    placed_at   timestamptz NOT NULL,
    released_at timestamptz,
    PRIMARY KEY (job_id, attempt, rank)
);
CREATE INDEX telemetry_placements_by_node ON telemetry_placements (node, placed_at DESC);

-- Every piece of evidence, correlated (job, attempt, rank) when a placement explains it.
CREATE TABLE telemetry_evidence (
    event_id   text        PRIMARY KEY,
    node       text        NOT NULL,
    kind       text        NOT NULL,
    category   text        NOT NULL,
    time       timestamptz NOT NULL,
    lane       text        NOT NULL,
    job_id     text,
    attempt    integer,
    rank       integer,
    data       jsonb       NOT NULL,
    stream_seq bigint      NOT NULL
);
CREATE INDEX telemetry_evidence_by_job ON telemetry_evidence (job_id, attempt) WHERE job_id IS NOT NULL;
CREATE INDEX telemetry_evidence_uncorrelated ON telemetry_evidence (node, time) WHERE job_id IS NULL;

-- Who has reported for an attempt (rank -1: node-level evidence), to know when to re-elect.
CREATE TABLE telemetry_reporters (
    job_id  text    NOT NULL,
    attempt integer NOT NULL,
    node    text    NOT NULL,
    rank    integer NOT NULL,
    PRIMARY KEY (job_id, attempt, node, rank)
);

-- The latest finding per attempt; `version` grows each time late evidence changes it.
CREATE TABLE telemetry_findings (
    job_id     text        NOT NULL,
    attempt    integer     NOT NULL,
    version    integer     NOT NULL,
    finding    jsonb       NOT NULL,
    first_node text,
    first_lane text,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, attempt)
);
CREATE INDEX telemetry_findings_by_first_node ON telemetry_findings (first_node) WHERE first_node IS NOT NULL;
