-- The nodes an attempt must never be placed on, carried by its AttemptRequested (e.g. the nodes recovery
-- cordoned after the previous attempt failed). Kept with the pending attempt so a restart still honours them.
ALTER TABLE scheduler_jobs ADD COLUMN avoid_nodes text[] NOT NULL DEFAULT '{}';
