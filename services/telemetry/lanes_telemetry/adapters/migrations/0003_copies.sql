-- How many consequences of each category telemetry copied to an attempt's timeline (the first few are
-- copied, the finding counts them all): a counter per attempt and category, added to under its row lock.
CREATE TABLE telemetry_copied (
    job_id   text    NOT NULL,
    attempt  integer NOT NULL,
    category text    NOT NULL,
    copied   integer NOT NULL,
    PRIMARY KEY (job_id, attempt, category)
);
