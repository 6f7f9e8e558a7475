-- What recovery knows per job (the folded knowledge as JSON) and when its next timer fires.
CREATE TABLE recovery_jobs (
    job_id      text        PRIMARY KEY,
    knowledge   jsonb       NOT NULL,
    next_due_at timestamptz,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX recovery_jobs_due ON recovery_jobs (next_due_at) WHERE next_due_at IS NOT NULL;

-- Every decision recovery published, for SQL users and as a guard: one policy decision per failed attempt.
CREATE TABLE recovery_decisions (
    decision_id   text        PRIMARY KEY,
    job_id        text        NOT NULL,
    attempt       integer     NOT NULL,
    action        text        NOT NULL,
    first_error   text        NOT NULL,
    finding_id    text        NOT NULL,
    policy        text        NOT NULL,
    policy_version integer    NOT NULL,
    owner         text        NOT NULL,
    manual_action text,
    requested_by  text        NOT NULL,
    deadline      timestamptz,
    escalated_at  timestamptz,
    decided_at    timestamptz NOT NULL,
    decision      jsonb       NOT NULL
);
CREATE UNIQUE INDEX recovery_one_policy_decision_per_attempt
    ON recovery_decisions (job_id, attempt) WHERE manual_action IS NULL;
CREATE INDEX recovery_decisions_by_job ON recovery_decisions (job_id, decided_at);
