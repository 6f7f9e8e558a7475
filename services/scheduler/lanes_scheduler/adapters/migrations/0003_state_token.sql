-- A token that changes with every commit that changes capacity (nodes, policy, allocations). A scheduler
-- process keeps its in-memory capacity view keyed by the token it last wrote: if the token in the database
-- is still that one, nobody else (no other process, no rolled-back transaction) changed anything since.
CREATE TABLE scheduler_state (
    id    integer PRIMARY KEY CHECK (id = 1),
    token text    NOT NULL
);
INSERT INTO scheduler_state (id, token) VALUES (1, 'initial');
