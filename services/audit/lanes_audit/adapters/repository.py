"""The audit table: appending links and checkpoints, and reading the chain back."""

from __future__ import annotations

from lanes_audit.domain.chain import GENESIS, Link
from lanes_runtime.store import Db

# Appends read the chain head and then write after it; one lock keeps two recorders from forking the chain.
_APPEND_LOCK = 0x4155444954  # "AUDIT"


async def lock_chain(conn: Db) -> None:
    """Serialize appends until the end of the current transaction."""
    await conn.execute("SELECT pg_advisory_xact_lock($1)", _APPEND_LOCK)


async def head(conn: Db) -> tuple[int, int, bytes]:
    """(position, stream sequence, hash) of the last link, or (0, 0, GENESIS) for an empty chain."""
    row = await conn.fetchrow("SELECT position, seq, hash FROM audit_links ORDER BY position DESC LIMIT 1")
    return (0, 0, GENESIS) if row is None else (row["position"], row["seq"], bytes(row["hash"]))


async def append(conn: Db, stream: str, links: list[Link]) -> None:
    """Add links at the end of the chain."""
    await conn.executemany(
        "INSERT INTO audit_links (position, stream, seq, canonical, previous, hash) VALUES ($1, $2, $3, $4, $5, $6)",
        [(link.position, stream, link.seq, link.canonical, link.previous, link.hash) for link in links],
    )


async def add_checkpoint(conn: Db, position: int, chain_hash: bytes, public_key: bytes, signature: bytes) -> None:
    """Record a signed checkpoint of the chain head."""
    await conn.execute(
        """INSERT INTO audit_checkpoints (position, hash, public_key, signature) VALUES ($1, $2, $3, $4)
           ON CONFLICT (position) DO NOTHING""",
        position,
        chain_hash,
        public_key,
        signature,
    )


async def links(conn: Db) -> list[Link]:
    """The whole chain in position order."""
    rows = await conn.fetch("SELECT position, seq, canonical, previous, hash FROM audit_links ORDER BY position")
    return [
        Link(row["position"], row["seq"], bytes(row["canonical"]), bytes(row["previous"]), bytes(row["hash"]))
        for row in rows
    ]


async def checkpoints(conn: Db) -> list[tuple[int, bytes, bytes, bytes]]:
    """Every checkpoint as (position, hash, public key, signature)."""
    rows = await conn.fetch("SELECT position, hash, public_key, signature FROM audit_checkpoints ORDER BY position")
    return [(r["position"], bytes(r["hash"]), bytes(r["public_key"]), bytes(r["signature"])) for r in rows]
