-- Topology, node state, pools and quotas, full specs, wait-reason history and the release log.
ALTER TABLE scheduler_nodes
    ADD COLUMN nvlink_domain text,
    ADD COLUMN leaf          text,
    ADD COLUMN spine         text,
    ADD COLUMN rack          text,
    ADD COLUMN pool          text        NOT NULL DEFAULT 'default',
    ADD COLUMN state         text        NOT NULL DEFAULT 'ready'
        CHECK (state IN ('ready', 'cordoned', 'draining', 'unhealthy')),
    ADD COLUMN state_reason  text        NOT NULL DEFAULT '',
    ADD COLUMN state_owner   text,
    ADD COLUMN state_since   timestamptz;

ALTER TABLE scheduler_jobs
    ADD COLUMN spec     jsonb,
    ADD COLUMN tenant   text    NOT NULL DEFAULT 'default',
    ADD COLUMN pool     text    NOT NULL DEFAULT 'default',
    ADD COLUMN priority integer NOT NULL DEFAULT 0,
    DROP CONSTRAINT scheduler_jobs_status_check,
    ADD CONSTRAINT scheduler_jobs_status_check CHECK (status IN ('pending', 'placed', 'rejected', 'done'));

-- Pools and tenant quotas: one row, replaced by each policy event.
CREATE TABLE scheduler_policy (
    id     integer PRIMARY KEY CHECK (id = 1),
    policy jsonb   NOT NULL
);

-- Every reason a job attempt waited for, from when to when (times are those of the causing events, so a
-- rebuild from the log gives the same history).
CREATE TABLE scheduler_waits (
    job_id         text        NOT NULL,
    attempt        integer     NOT NULL,
    started_seq    bigint      NOT NULL,
    reason         text        NOT NULL,
    detail         text        NOT NULL,
    owner_lane     text,
    blocking       jsonb       NOT NULL DEFAULT '[]',
    figures        jsonb       NOT NULL DEFAULT '{}',
    queue_position integer,
    started_at     timestamptz NOT NULL,
    ended_at       timestamptz,
    ended_by       text,
    PRIMARY KEY (job_id, attempt, started_seq),
    FOREIGN KEY (job_id, attempt) REFERENCES scheduler_jobs (job_id, attempt)
);
-- At most one open reason per attempt.
CREATE UNIQUE INDEX scheduler_waits_open ON scheduler_waits (job_id, attempt) WHERE ended_at IS NULL;

-- Each release request and what became of it: released once, or refused as a double release.
CREATE TABLE scheduler_releases (
    job_id    text        NOT NULL,
    attempt   integer     NOT NULL,
    cause_id  text        NOT NULL PRIMARY KEY,
    outcome   text        NOT NULL CHECK (outcome IN ('released', 'double_release', 'unknown_attempt')),
    gpus      integer     NOT NULL DEFAULT 0,
    at        timestamptz NOT NULL
);
