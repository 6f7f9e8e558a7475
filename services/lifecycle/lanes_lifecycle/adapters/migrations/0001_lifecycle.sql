-- The lifecycle projection: one row per job, the folded view as JSON plus the columns queries need.
CREATE TABLE lifecycle_jobs (
    job_id     text        PRIMARY KEY,
    state      text        NOT NULL,
    attempt    integer     NOT NULL,
    view       jsonb       NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX lifecycle_jobs_by_state ON lifecycle_jobs (state);
