-- A fresh random token on every write of a job's view. The consumer keeps the views it parsed by token, so a
-- fold re-reads a view only when someone else (another replica, a rebuild) wrote it since; a write that
-- rolled back leaves a token no row holds, so a stale view is never taken for a stored one.
ALTER TABLE lifecycle_jobs ADD COLUMN revision uuid;
