"""The audit recorder and `lanes audit verify` on real servers: tampering is found, a clean copy verifies."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator

import asyncpg
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import REGISTRY, generate_latest
from support.cli import run_lanes_async
from support.contract import submission
from support.logs import json_logs
from support.waiting import eventually

from lanes_audit.adapters.signing import Signer
from lanes_audit.domain.chain import ProblemKind
from lanes_audit.entrypoints.recorder import AuditRecorder
from lanes_cli.audit_cli import verify
from lanes_cli.console import EXIT_BAD_INPUT, EXIT_FAILED
from lanes_contract.client import LanesClient, publish_encoded
from lanes_contract.codec import encode
from lanes_contract.streams import JOBS
from lanes_runtime import upkeep
from lanes_runtime.settings import ServerUrls
from lanes_runtime.store import apply_migrations, apply_runtime_migrations, create_pool, migrations_of

pytestmark = pytest.mark.real_servers


@pytest.fixture
async def pool(urls: ServerUrls) -> AsyncIterator[asyncpg.Pool]:
    db = await create_pool(urls.database_url)
    await apply_runtime_migrations(db)  # the recorder's durable keeps its ack floor there, as a service's does
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
    recorded: Signer, urls: ServerUrls, pool: asyncpg.Pool, unique: str
) -> None:
    signer = recorded
    verdict = await verify(urls.nats_url, urls.database_url, signer.public_key, recorder=f"audit-{unique}")
    assert verdict.problems == [], verdict.as_json()
    assert verdict.links == await pool.fetchval("SELECT count(*) FROM audit_links")
    assert verdict.checkpoints == verdict.links // 5
    stranger = Signer(Ed25519PrivateKey.generate()).public_key
    untrusted = await verify(urls.nats_url, urls.database_url, stranger, recorder=f"audit-{unique}")
    assert untrusted.problem is not None
    assert "untrusted key" in untrusted.problem.detail
    # Every checkpoint is named, not only the first.
    assert sum("untrusted key" in p.detail for p in untrusted.problems) == verdict.checkpoints


async def test_events_the_recorder_has_not_reached_are_lag_not_loss(
    recorded: Signer, lanes: LanesClient, urls: ServerUrls, unique: str
) -> None:
    for _ in range(3):  # the recorder is stopped: nothing acknowledged these, nothing proves they were recorded
        await lanes.publish(submission(f"late-{unique}"))
    verdict = await verify(urls.nats_url, urls.database_url, recorded.public_key, recorder=f"audit-{unique}")
    assert verdict.problems == [], verdict.as_json()
    assert verdict.not_yet_recorded >= 3


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
    recorded: Signer, urls: ServerUrls, pool: asyncpg.Pool, *, sql: str, kind: ProblemKind, unique: str
) -> None:
    middle = int(await pool.fetchval("SELECT max(position) / 2 FROM audit_links"))
    await _tamper(pool, sql.format(p=middle))
    verdict = await verify(urls.nats_url, urls.database_url, None, recorder=f"audit-{unique}")
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
    verdict = await verify(urls.nats_url, urls.database_url, None, recorder=f"bulk-{unique}")
    assert verdict.problems == [], verdict.as_json()
    assert verdict.links >= 100_000


async def _acknowledged(lanes: LanesClient, durable: str) -> int:
    info = await lanes.js.consumer_info(JOBS.name, durable)
    return int(info.ack_floor.stream_seq)


async def _all_acknowledged(lanes: LanesClient, pool: asyncpg.Pool, durable: str) -> int:
    """The chain head's sequence, once the recorder's ack floor has reached it (acks are settled asynchronously)."""
    head = int(await pool.fetchval("SELECT max(seq) FROM audit_links"))

    async def reached() -> bool:
        return await _acknowledged(lanes, durable) >= head

    await eventually(reached, what="the recorder's acks to reach the chain head")
    return head


async def test_rows_deleted_after_the_recorder_acknowledged_them_are_loss(
    recorded: Signer, lanes: LanesClient, urls: ServerUrls, pool: asyncpg.Pool, unique: str
) -> None:
    durable = f"audit-{unique}"
    head = await _all_acknowledged(lanes, pool, durable)
    # A database superuser deletes the last five rows: before, verify took them for events not yet recorded.
    await _tamper(pool, "DELETE FROM audit_links WHERE position > (SELECT max(position) - 5 FROM audit_links)")

    ran = await run_lanes_async(urls, "audit", "verify", "--recorder", durable)
    assert ran.returncode == EXIT_FAILED, ran.stdout + ran.stderr
    assert (
        f"missing: 5 (first at sequence {head - 4}: in the stream, not in the audit copy); sequences {head - 4}-{head}"
        in ran.stderr
    )
    assert (
        f"stalled: 1 (first at sequence {head - 4}: recorder {durable} acknowledged through sequence {head}"
        in ran.stderr
    )
    assert "newer events not yet recorded" not in ran.stdout

    as_json = await run_lanes_async(urls, "audit", "verify", "--recorder", durable, "--json")
    assert as_json.returncode == EXIT_FAILED
    verdict = json.loads(as_json.stdout)
    assert verdict["ok"] is False
    missing = next(kind for kind in verdict["problems"] if kind["kind"] == "missing")
    assert (missing["count"], missing["seqs"]) == (5, [[head - 4, head]])


async def test_a_signed_checkpoint_proves_rows_existed_without_the_recorder(
    recorded: Signer, lanes: LanesClient, urls: ServerUrls, pool: asyncpg.Pool, unique: str
) -> None:
    # No ack floor to go by (the recorder's consumer is gone): the last checkpoint still covers its position.
    await lanes.js.delete_consumer(JOBS.name, f"audit-{unique}")
    checkpointed = int(await pool.fetchval("SELECT max(position) FROM audit_checkpoints"))
    rows = await pool.fetch("SELECT position, seq FROM audit_links WHERE position > $1 - 3", checkpointed)
    await _tamper(pool, "DELETE FROM audit_links WHERE position > (SELECT max(position) FROM audit_checkpoints) - 3")
    covered = [row["seq"] for row in rows if row["position"] <= checkpointed]

    verdict = await verify(urls.nats_url, urls.database_url, recorded.public_key, recorder=f"audit-{unique}")
    missing = [p.seq for p in verdict.problems if p.kind is ProblemKind.MISSING and p.seq is not None]
    assert missing == covered
    assert len(covered) == 3


async def _ready(recorder: AuditRecorder) -> bool:
    return recorder.ready


async def test_a_recorder_stuck_on_a_gap_turns_not_ready_and_verify_names_it(
    lanes: LanesClient, urls: ServerUrls, pool: asyncpg.Pool, unique: str, capsys: pytest.CaptureFixture[str]
) -> None:
    durable = f"stuck-{unique}"
    for _ in range(6):
        await lanes.publish(submission(f"stuck-{unique}"))
    recorder = AuditRecorder(
        lanes._nc, pool, signer=Signer(Ed25519PrivateKey.generate()), durable=durable, gap_bound_s=0.5
    )
    stop = asyncio.Event()
    with json_logs(capsys) as logs:
        task = asyncio.create_task(recorder.run(stop))
        try:
            last = (await lanes.js.stream_info(JOBS.name)).state.last_seq

            async def caught_up() -> bool:
                return bool(await pool.fetchval("SELECT coalesce(max(seq), 0) >= $1 FROM audit_links", last))

            await eventually(caught_up, timeout_s=60, what="the recorder to reach the end of the stream")
            head = await _all_acknowledged(lanes, pool, durable)
            deleted = await pool.fetch(
                "SELECT position, stream, seq, canonical, previous, hash FROM audit_links "
                "WHERE position > (SELECT max(position) - 3 FROM audit_links)"
            )
            await _tamper(pool, "DELETE FROM audit_links WHERE position > (SELECT max(position) - 3 FROM audit_links)")
            for _ in range(2):  # the recorder now waits for sequences that were acknowledged and never come back
                await lanes.publish(submission(f"after-{unique}"))

            async def not_ready() -> bool:
                return not await _ready(recorder)

            await eventually(not_ready, what="the stuck recorder to turn not ready")
            assert REGISTRY.get_sample_value("lanes_consumer_ready", {"consumer": durable}) == 0
            stuck = [line for line in logs.about(durable) if line["event"].startswith("audit: stuck on a gap")]
            assert [(line["level"], line["missing"]) for line in stuck] == [("error", f"{head - 2}-{head}")]

            ran = await run_lanes_async(urls, "audit", "verify", "--recorder", durable)
            assert ran.returncode == EXIT_FAILED, ran.stdout + ran.stderr
            assert f"stalled: 1 (first at sequence {head - 2}: recorder {durable} acknowledged" in ran.stderr
            assert f"missing: 3 (first at sequence {head - 2}" in ran.stderr

            # The rows put back (from a backup, say): the gap fills, the recorder goes on and is ready again.
            await pool.executemany(
                "INSERT INTO audit_links (position, stream, seq, canonical, previous, hash) "
                "VALUES ($1, $2, $3, $4, $5, $6)",
                [tuple(row) for row in deleted],
            )
            last = (await lanes.js.stream_info(JOBS.name)).state.last_seq
            await eventually(caught_up, timeout_s=60, what="the recorder to go on past the filled gap")
            await eventually(lambda: _ready(recorder), what="the recorder ready again")
            assert REGISTRY.get_sample_value("lanes_consumer_ready", {"consumer": durable}) == 1
            assert (await verify(urls.nats_url, urls.database_url, None, recorder=durable)).problems == []
        finally:
            stop.set()
            await asyncio.wait_for(task, timeout=10)


@pytest.mark.parametrize("harm", ["deleted", "re-filtered"])
async def test_a_recorder_whose_durable_is_deleted_or_re_filtered_restores_it_and_the_copy_misses_nothing(
    lanes: LanesClient,
    urls: ServerUrls,
    pool: asyncpg.Pool,
    unique: str,
    *,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    harm: str,
) -> None:
    """Issue 34, item 1: before, the audit copy stopped for good and `verify` called the rest "not yet recorded"."""
    monkeypatch.setattr(upkeep, "CHECK_EVERY_S", 0.5)  # the same path as every three seconds, sooner
    durable = f"kept-{unique}"
    for _ in range(5):
        await lanes.publish(submission(f"kept-{unique}"))
    stop = asyncio.Event()

    async def caught_up(last: int) -> bool:
        return bool(await pool.fetchval("SELECT coalesce(max(seq), 0) >= $1 FROM audit_links", last))

    with json_logs(capsys) as logs:
        recorder = AuditRecorder(lanes._nc, pool, signer=Signer(Ed25519PrivateKey.generate()), durable=durable)
        task = asyncio.create_task(recorder.run(stop))
        try:
            first = (await lanes.js.stream_info(JOBS.name)).state.last_seq
            await eventually(lambda: caught_up(first), timeout_s=60, what="the copy to reach the end of the stream")
            head = await _all_acknowledged(lanes, pool, durable)
            if harm == "deleted":
                await lanes.js.delete_consumer(JOBS.name, durable)
            else:  # as issue 34 reproduced it: a filter that matches nothing, set by a body naming the durable
                bent = dataclasses.replace(recorder.config(), filter_subjects=["lanes.job.no-such-job.>"])
                await lanes.js.add_consumer(JOBS.name, config=bent)
            for _ in range(5):
                await lanes.publish(submission(f"kept-after-{unique}"))
            last = (await lanes.js.stream_info(JOBS.name)).state.last_seq
            assert last > head
            await eventually(lambda: caught_up(last), timeout_s=60, what="the copy to reach the end of the stream")
            await eventually(lambda: _ready(recorder), what="the recorder ready again")
        finally:
            stop.set()
            await asyncio.wait_for(task, timeout=10)
    restored = [line for line in logs.about(durable) if line["event"] == "durable consumer restored"]
    assert len(restored) >= 1
    assert (await verify(urls.nats_url, urls.database_url, None, recorder=durable)).problems == []


@pytest.mark.parametrize("name", ["audit.>", "*", "", "a" * 129])
async def test_a_recorder_name_that_is_no_single_token_is_refused(urls: ServerUrls, name: str) -> None:
    # It becomes a token of `$JS.API.CONSUMER.INFO.<stream>.<name>`: a wildcard would ask about other consumers.
    ran = await run_lanes_async(urls, "audit", "verify", "--recorder", name)
    assert ran.returncode == EXIT_BAD_INPUT
    assert "a consumer name is 1-128 characters" in ran.stderr
