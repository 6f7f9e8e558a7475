CREATE TABLE scheduler_nodes (
    node_id        text    PRIMARY KEY,
    gpu_model      text    NOT NULL,
    gpus           integer NOT NULL CHECK (gpus >= 0),
    gpu_memory_gib integer NOT NULL,
    labels         jsonb   NOT NULL DEFAULT '{}'
);

-- One row per job attempt the scheduler knows; `placed` jobs hold allocations until released.
CREATE TABLE scheduler_jobs (
    job_id      text    NOT NULL,
    attempt     integer NOT NULL,
    workers     integer NOT NULL,
    gpus_per_worker integer NOT NULL,
    gpu_model   text,
    status      text    NOT NULL CHECK (status IN ('pending', 'placed', 'done')),
    wait_reason text,
    submitted_seq bigint NOT NULL,
    PRIMARY KEY (job_id, attempt)
);
CREATE INDEX scheduler_jobs_pending ON scheduler_jobs (submitted_seq) WHERE status = 'pending';

-- A GPU is held by at most one rank: the primary key makes double-booking impossible.
CREATE TABLE scheduler_allocations (
    node_id   text    NOT NULL REFERENCES scheduler_nodes (node_id),
    gpu_index integer NOT NULL,
    job_id    text    NOT NULL,
    attempt   integer NOT NULL,
    rank      integer NOT NULL,
    PRIMARY KEY (node_id, gpu_index),
    FOREIGN KEY (job_id, attempt) REFERENCES scheduler_jobs (job_id, attempt)
);
CREATE INDEX scheduler_allocations_by_job ON scheduler_allocations (job_id, attempt);
