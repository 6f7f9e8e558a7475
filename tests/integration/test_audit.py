"""The audit recorder and `lanes audit verify` on real servers: tampering is found, a clean copy verifies."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import REGISTRY, generate_latest
from support.contract import submission
from support.waiting import eventually

from lanes_audit.adapters.signing import Signer
from lanes_audit.domain.chain import ProblemKind
from lanes_audit.entrypoints.recorder import AuditRecorder
from lanes_cli.audit_cli import verify
from lanes_contract.client import LanesClient, publish_encoded
from lanes_contract.codec import encode
from lanes_contract.streams import JOBS
from lanes_runtime.settings import ServerUrls
from lanes_runtime.store import apply_migrations, create_pool, migrations_of

pytestmark = pytest.mark.real_servers


@pytest.fixture
async def pool(urls: ServerUrls) -> AsyncIterator[asyncpg.Pool]:
    db = await create_pool(urls.database_url)
    await apply_migrations(db, "audit", migrations_of("lanes_audit.adapters"))
    yield db
    await db.close()


async def _record_everything(lanes: LanesClient, pool: asyncpg.Pool, recorder: AuditRecorder) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(recorder.run(stop))
    last = (await lanes.js.stream_info(JOBS.name)).state.last_seq

    async def caught_up() -> bool:
        return bool(await pool.fetchval("SELECT coalesce(max(seq), 0) >= $1 FROM audit_links", last))

    await eventually(caught_up, timeout_s=120, what="the recorder to reach the end of the stream")
    stop.set()
    await asyncio.wait_for(task, timeout=10)


async def _tamper(pool: asyncpg.Pool, sql: str) -> None:
    # An attacker with database access: the append-only trigger has to be switched off first.
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("ALTER TABLE audit_links DISABLE TRIGGER audit_links_no_change")
        await conn.execute(sql)
        await conn.execute("ALTER TABLE audit_links ENABLE TRIGGER audit_links_no_change")


@pytest.fixture
async def recorded(lanes: LanesClient, pool: asyncpg.Pool, unique: str) -> Signer:
    """A recorded history of this test's events (and everything before them); returns the signing key."""
    for _ in range(12):
        await lanes.publish(submission(f"audit-{unique}"))
    # An undecodable message is part of the history too, byte for byte.
    await lanes.js.publish(f"lanes.job.audit-{unique}.submitted", b"\xff not json")
    signer = Signer(Ed25519PrivateKey.generate())
    recorder = AuditRecorder(lanes._nc, pool, signer=signer, checkpoint_every=5, durable=f"audit-{unique}")
    await _record_everything(lanes, pool, recorder)
    return signer


async def test_a_clean_copy_verifies_with_signed_checkpoints(
    recorded: Signer, urls: ServerUrls, pool: asyncpg.Pool
) -> None:
    signer = recorded
    verdict = await verify(urls.nats_url, urls.database_url, signer.public_key)
    assert verdict.problem is None, verdict.as_json()
    assert verdict.links == await pool.fetchval("SELECT count(*) FROM audit_links")
    assert verdict.checkpoints == verdict.links // 5
    stranger = Signer(Ed25519PrivateKey.generate()).public_key
    untrusted = await verify(urls.nats_url, urls.database_url, stranger)
    assert untrusted.problem is not None
    assert "untrusted key" in untrusted.problem.detail


async def test_the_recorder_exports_the_consumer_metrics_the_services_do(recorded: Signer, unique: str) -> None:
    # The same `lanes_consumer_*` families as every service's consumer, under the recorder's durable name.
    body = generate_latest(REGISTRY).decode()
    durable = f"audit-{unique}"
    processed = REGISTRY.get_sample_value("lanes_consumer_events_total", {"consumer": durable, "outcome": "processed"})
    assert processed is not None
    assert processed >= 13  # this test's 12 events and its undecodable message, and whatever came before
    for family in ("lanes_consumer_batch_size", "lanes_consumer_handler_seconds", "lanes_consumer_commit_seconds"):
        assert f'{family}_count{{consumer="{durable}"}}' in body
    assert f'lanes_consumer_ready{{consumer="{durable}"}} 1.0' in body
    assert f'lanes_consumer_pending{{consumer="{durable}"}}' in body
    assert f'lanes_consumer_held_total{{consumer="{durable}"}}' in body


async def test_the_table_refuses_changes(recorded: Signer, pool: asyncpg.Pool) -> None:
    with pytest.raises(asyncpg.RaiseError, match="append-only"):
        await pool.execute("DELETE FROM audit_links WHERE position = 1")


@pytest.mark.parametrize(
    ("sql", "kind"),
    [
        ("UPDATE audit_links SET canonical = canonical || '\\x00'::bytea WHERE position = {p}", ProblemKind.ALTERED),
        ("DELETE FROM audit_links WHERE position = {p}", ProblemKind.MISSING),
        (
            (
                "UPDATE audit_links SET position = -1 WHERE position = {p};"
                "UPDATE audit_links SET position = {p} WHERE position = {p} + 1;"
                "UPDATE audit_links SET position = {p} + 1 WHERE position = -1"
            ),
            ProblemKind.REORDERED,
        ),
        (
            (
                "INSERT INTO audit_links (position, stream, seq, canonical, previous, hash) "
                "SELECT max(position) + 1, 'LANES_JOBS', max(seq) + 100000, '\\x00'::bytea, '\\x00'::bytea, "
                "'\\x00'::bytea FROM audit_links"
            ),
            ProblemKind.BROKEN_LINK,
        ),
    ],
    ids=["altered", "deleted", "reordered", "injected"],
)
async def test_tampering_is_found_at_its_place(
    recorded: Signer, urls: ServerUrls, pool: asyncpg.Pool, sql: str, kind: ProblemKind
) -> None:
    middle = int(await pool.fetchval("SELECT max(position) / 2 FROM audit_links"))
    await _tamper(pool, sql.format(p=middle))
    verdict = await verify(urls.nats_url, urls.database_url, None)
    assert verdict.problem is not None
    if kind is ProblemKind.REORDERED:
        assert verdict.problem.kind in {ProblemKind.REORDERED, ProblemKind.BROKEN_LINK}
        assert verdict.problem.position == middle
    elif kind is ProblemKind.BROKEN_LINK:  # an injected row that does not even link up
        assert verdict.problem.kind is ProblemKind.BROKEN_LINK
    else:
        assert verdict.problem.kind is kind
        assert verdict.problem.position == middle


@pytest.mark.slow
async def test_a_large_clean_history_raises_no_false_alarm(
    lanes: LanesClient, pool: asyncpg.Pool, urls: ServerUrls, unique: str
) -> None:
    encoded = [encode(submission(f"bulk-{unique}-{i % 100}")) for i in range(100)]
    for start in range(0, 100_000, 1000):
        await asyncio.gather(
            *(
                publish_encoded(
                    lanes.js,
                    type(e)(e.subject, e.headers | {"Nats-Msg-Id": f"bulk-{unique}-{start + i}"}, e.payload),
                    stream=JOBS.name,
                )
                for i, e in enumerate(encoded * 10)
            )
        )
    recorder = AuditRecorder(lanes._nc, pool, signer=Signer(Ed25519PrivateKey.generate()), durable=f"bulk-{unique}")
    await _record_everything(lanes, pool, recorder)
    verdict = await verify(urls.nats_url, urls.database_url, None)
    assert verdict.problem is None, verdict.as_json()
    assert verdict.links >= 100_000
