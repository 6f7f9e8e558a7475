-- How many consequences (timeouts, aborts) of each category an attempt has had: the first few are copied to
-- the job's timeline, the finding counts them all. Added to under the row's lock, so replicas never both
-- take the same numbers.
CREATE TABLE telemetry_consequences (
    job_id   text    NOT NULL,
    attempt  integer NOT NULL,
    category text    NOT NULL,
    counted  integer NOT NULL,
    PRIMARY KEY (job_id, attempt, category)
);
