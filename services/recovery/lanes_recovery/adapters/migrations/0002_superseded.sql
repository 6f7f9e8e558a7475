-- A decision a later, settled finding contradicted is superseded: it stays on record, and the one policy
-- decision per failed attempt that the unique index guards is the one in force.
ALTER TABLE recovery_decisions ADD COLUMN superseded_by text;
DROP INDEX recovery_one_policy_decision_per_attempt;
CREATE UNIQUE INDEX recovery_one_policy_decision_per_attempt
    ON recovery_decisions (job_id, attempt) WHERE manual_action IS NULL AND superseded_by IS NULL;
