-- The append-only audit copy of the timeline. Each row is one link of a SHA-256 hash chain.
CREATE TABLE audit_links (
    position   bigint      PRIMARY KEY,
    stream     text        NOT NULL,
    seq        bigint      NOT NULL,
    canonical  bytea       NOT NULL,
    previous   bytea       NOT NULL,
    hash       bytea       NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    UNIQUE (stream, seq)
);

-- Rows are only ever added: the database refuses updates and deletes through this table.
CREATE FUNCTION audit_links_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'audit_links is append-only';
END $$;
CREATE TRIGGER audit_links_no_change BEFORE UPDATE OR DELETE ON audit_links
    FOR EACH STATEMENT EXECUTE FUNCTION audit_links_append_only();

-- Signed checkpoints: the chain head at a position, signed with the audit key (Ed25519).
CREATE TABLE audit_checkpoints (
    position   bigint      PRIMARY KEY,
    hash       bytea       NOT NULL,
    public_key bytea       NOT NULL,
    signature  bytea       NOT NULL,
    signed_at  timestamptz NOT NULL DEFAULT now()
);
