"""PostgreSQL access: an asyncpg pool and plain-SQL migrations applied at start-up.

Each component (lanes_contract, and each service) owns a directory of numbered `.sql` files. Migrations are
applied in name order under an advisory lock, each in its own transaction, and recorded with a checksum so
an edited migration that was already applied is reported instead of silently diverging.
"""

from __future__ import annotations

import hashlib
from importlib.resources import files
from importlib.resources.abc import Traversable
from typing import TYPE_CHECKING, TypeAlias

import asyncpg
import structlog
from asyncpg.pool import PoolConnectionProxy

from lanes_contract.errors import ServerUnavailableError, UnsupportedServerError

if TYPE_CHECKING:
    Db: TypeAlias = asyncpg.Connection[asyncpg.Record] | PoolConnectionProxy[asyncpg.Record]
else:  # the classes are generic only in the type stubs
    Db = asyncpg.Connection | PoolConnectionProxy
"""A connection, plain or borrowed from a pool; handlers and repositories accept either."""

MIN_POSTGRES_VERSION = 150000
_MIGRATION_LOCK = 0x4C414E4553  # "LANES": one advisory lock key for every process applying migrations
log = structlog.get_logger(__name__)


async def create_pool(dsn: str, *, min_size: int = 1, max_size: int = 10) -> asyncpg.Pool:
    """Open a connection pool, or raise ServerUnavailableError / UnsupportedServerError with the reason."""
    try:
        pool = await asyncpg.create_pool(dsn, min_size=min_size, max_size=max_size, command_timeout=30)
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        msg = f"cannot reach PostgreSQL at {_redacted(dsn)}: {exc}"
        raise ServerUnavailableError(msg) from exc
    version = await pool.fetchval("SHOW server_version_num")
    if int(version) < MIN_POSTGRES_VERSION:
        await pool.close()
        msg = f"PostgreSQL at {_redacted(dsn)} is version {version}; Lanes needs PostgreSQL >= 15"
        raise UnsupportedServerError(msg)
    return pool


def _redacted(dsn: str) -> str:
    scheme, sep, rest = dsn.partition("://")
    if "@" not in rest:
        return dsn
    credentials, _, host = rest.rpartition("@")
    user = credentials.split(":", 1)[0]
    return f"{scheme}{sep}{user}@{host}"


def migrations_of(package: str) -> Traversable:
    """The migrations directory shipped inside a package (`<package>/migrations`)."""
    return files(package).joinpath("migrations")


async def apply_migrations(pool: asyncpg.Pool, component: str, directory: Traversable) -> list[str]:
    """Apply the not-yet-applied `.sql` files of `directory`; return the names applied now."""
    scripts = sorted((entry.name, entry.read_text()) for entry in directory.iterdir() if entry.name.endswith(".sql"))
    applied_now: list[str] = []
    async with pool.acquire() as conn:
        await conn.execute("SELECT pg_advisory_lock($1)", _MIGRATION_LOCK)
        try:
            await conn.execute(
                """CREATE TABLE IF NOT EXISTS lanes_migrations (
                       component text NOT NULL, name text NOT NULL, checksum text NOT NULL,
                       applied_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (component, name))"""
            )
            done = {
                row["name"]: row["checksum"]
                for row in await conn.fetch(
                    "SELECT name, checksum FROM lanes_migrations WHERE component = $1", component
                )
            }
            for name, sql in scripts:
                checksum = hashlib.sha256(sql.encode()).hexdigest()
                if name in done:
                    if done[name] != checksum:
                        msg = f"migration {component}/{name} changed after it was applied; add a new migration instead"
                        raise RuntimeError(msg)
                    continue
                async with conn.transaction():
                    await conn.execute(sql)
                    await conn.execute(
                        "INSERT INTO lanes_migrations (component, name, checksum) VALUES ($1, $2, $3)",
                        component,
                        name,
                        checksum,
                    )
                applied_now.append(name)
        finally:
            await conn.execute("SELECT pg_advisory_unlock($1)", _MIGRATION_LOCK)
    if applied_now:
        log.info("migrations applied", component=component, names=applied_now)
    return applied_now


async def apply_runtime_migrations(pool: asyncpg.Pool) -> list[str]:
    """Apply the consumer runtime's own tables (processed-event records), shared by every service."""
    return await apply_migrations(pool, "lanes_runtime", migrations_of("lanes_runtime"))
