-- The cordon budget counts the nodes cordoned by recent decisions of every job: read by time.
CREATE INDEX recovery_decisions_by_time ON recovery_decisions (decided_at);
