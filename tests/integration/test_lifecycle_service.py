"""The lifecycle service on real NATS JetStream and PostgreSQL: transitions on the log, rejections kept
visible, crash safety under SIGKILL and per-job optimistic concurrency between replicas."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from support.cli import run_lanes_async
from support.lifecycle import clean_run, lifecycle_spec, long_story
from support.waiting import eventually

from lanes_cli.timeline import read_stream
from lanes_contract.client import LanesClient
from lanes_contract.events import (
    CancelRequested,
    CommandData,
    Event,
    JobStateChanged,
    RankExited,
    RankExitedData,
    TransitionRejected,
)
from lanes_contract.jobs import JobState
from lanes_contract.streams import DEAD, JOBS, provision_streams
from lanes_lifecycle.adapters import repository
from lanes_lifecycle.adapters.transitions import TransitionConflictError
from lanes_lifecycle.domain.job import IllegalTransitionError, evolve
from lanes_lifecycle.entrypoints.service import SERVICE, job_event_handler
from lanes_runtime.consumer import EventConsumer, Handler, HandlerContext, TransactionScope
from lanes_runtime.reader import Selection
from lanes_runtime.settings import ServerUrls
from lanes_runtime.store import apply_migrations, apply_runtime_migrations, create_pool

pytestmark = pytest.mark.real_servers
CHILD = Path(__file__).parent / "lifecycle_child.py"


async def _pool(url: str) -> asyncpg.Pool:
    pool = await create_pool(url)
    await apply_runtime_migrations(pool)
    assert SERVICE.migrations is not None
    await apply_migrations(pool, "lifecycle", SERVICE.migrations)
    return pool


@pytest.fixture
async def pool(urls: ServerUrls) -> AsyncIterator[asyncpg.Pool]:
    db = await _pool(urls.database_url)
    yield db
    await db.close()


@pytest.fixture
async def second_database(servers: ServerUrls) -> AsyncIterator[str]:
    """Another fresh database: the projection of a second lifecycle replica that shares nothing with the first."""
    name = f"lanes_test_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(servers.database_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        base, _, _ = servers.database_url.rpartition("/")
        yield f"{base}/{name}"
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


async def _events(lanes: LanesClient, subject: str) -> list[Event]:
    entries = await read_stream(lanes.js, Selection(JOBS.name, subject))
    return [e.event for e in entries if e.event is not None]


async def _transitions(lanes: LanesClient, job_id: str) -> list[JobStateChanged]:
    return [e for e in await _events(lanes, f"lanes.job.{job_id}.state_changed") if isinstance(e, JobStateChanged)]


async def _dead_letters(lanes: LanesClient, durable: str) -> int:
    info = await lanes.js.stream_info(DEAD.name, subjects_filter=f"lanes.dead.{JOBS.name}.{durable}")
    return sum((info.state.subjects or {}).values())


def _as_expected(events: list[Event]) -> list[tuple[str | None, str, str]]:
    _, transitions, _ = clean_run(events)
    return [(t.from_state, t.to_state.value, cause.id) for t, cause in transitions]


def _as_logged(changes: list[JobStateChanged]) -> list[tuple[str | None, str, str]]:
    return [(c.data.from_state, c.data.to_state.value, str(c.causationid)) for c in changes]


async def _processed(pool: asyncpg.Pool, durable: str) -> int:
    """Events recorded and folded (an ordered consumer stages an event in its inbox before folding it)."""
    count = await pool.fetchval(
        """SELECT count(*) FROM lanes_processed p WHERE consumer = $1
           AND NOT EXISTS (SELECT 1 FROM lanes_inbox i WHERE i.consumer = p.consumer AND i.event_id = p.event_id)""",
        durable,
    )
    return int(count)


# --- in process ----------------------------------------------------------------------------------


async def test_a_story_is_folded_into_jobs_attempts_ranks_and_spans_and_a_stray_is_rejected_visibly(
    lanes: LanesClient, pool: asyncpg.Pool, unique: str
) -> None:
    job_id = f"life-{unique}"
    durable = f"life-{unique}"
    events = long_story(job_id, total=400)
    consumer = EventConsumer(lanes._nc, pool, lifecycle_spec(durable, job_id), job_event_handler(lanes.js))
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        for event in events:
            await lanes.publish(event)
        await eventually(lambda: _count_is(pool, durable, len(events)), timeout_s=120, what="all events processed")
    finally:
        stop.set()
        await task

    expected_view, _, rejected = clean_run(events)
    assert rejected
    async with pool.acquire() as conn:
        view = await repository.load(conn, job_id)
    assert view == expected_view
    assert _as_logged(await _transitions(lanes, job_id)) == _as_expected(events)
    rejections = [
        e for e in await _events(lanes, f"lanes.job.{job_id}.transition_rejected") if isinstance(e, TransitionRejected)
    ]
    assert [r.data.event_id for r in rejections] == [e.id for e in rejected]
    assert all("not allowed" in r.data.reason for r in rejections)
    assert await _dead_letters(lanes, durable) == 0  # an illegal transition is a fact about the job, not poison

    attempts = await pool.fetch("SELECT * FROM lifecycle_attempts WHERE job_id = $1 ORDER BY attempt", job_id)
    assert [a["attempt"] for a in attempts] == [a.number for a in expected_view.attempts]
    assert attempts[0]["cause"] == "user_code_error"
    assert attempts[0]["released"]
    ranks = await pool.fetch("SELECT rank, state FROM lifecycle_ranks WHERE job_id = $1 AND attempt = 1", job_id)
    assert sorted((r["rank"], r["state"]) for r in ranks) == [
        (0, "failed"),
        (1, "failed"),
        (2, "failed"),
        (3, "failed"),
    ]
    spans = await pool.fetch("SELECT state FROM lifecycle_state_spans WHERE job_id = $1 ORDER BY position", job_id)
    assert [s["state"] for s in spans] == [s.state.value for s in expected_view.history]


async def _unpublished(pool: asyncpg.Pool, durable: str) -> int:
    """Outbox rows of the consumer not yet published (a crash between commit and publish leaves them)."""
    return int(await pool.fetchval("SELECT count(*) FROM lanes_outbox WHERE consumer = $1", durable))


async def _all_published(pool: asyncpg.Pool, durable: str) -> bool:
    return await _unpublished(pool, durable) == 0


async def _count_is(pool: asyncpg.Pool, durable: str, expected: int) -> bool:
    return await _processed(pool, durable) >= expected


# --- crash safety --------------------------------------------------------------------------------


def _start_child(
    urls: ServerUrls, database_url: str, durable: str, job_id: str, per_mille: int
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(CHILD), urls.nats_url, database_url, durable, job_id, str(per_mille)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


async def _wait_ready(child: subprocess.Popen[str]) -> None:
    assert child.stdout is not None
    line = await asyncio.to_thread(child.stdout.readline)
    if not line:  # it died before it was ready (it may kill itself): let the caller start another
        await asyncio.to_thread(child.wait, 30)
        return
    assert line.strip() == "ready"


def _kill(child: subprocess.Popen[str]) -> None:
    if child.poll() is None:
        child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)


@pytest.mark.slow
async def test_sigkill_at_random_points_during_2000_events_ends_with_exactly_the_clean_transitions(
    lanes: LanesClient, pool: asyncpg.Pool, urls: ServerUrls, unique: str
) -> None:
    job_id = f"crash-{unique}"
    durable = f"crash-{unique}"
    events = long_story(job_id, total=2000)
    rnd = random.Random(unique)  # noqa: S311 - reproducible kill times per run id

    async def publish_all() -> None:
        for event in events:
            await lanes.publish(event)

    publisher = asyncio.create_task(publish_all())
    kills = 0
    child = _start_child(urls, urls.database_url, durable, job_id, per_mille=1)
    try:
        deadline = time.monotonic() + 240  # fail instead of hanging if an event can never be processed
        # Until every event is folded and every event its handler decided to publish is out: a child killed
        # between its commit and its publish leaves outbox rows that the next child's redelivery publishes.
        while await _processed(pool, durable) < len(events) or await _unpublished(pool, durable):
            assert time.monotonic() < deadline, f"stuck at {await _processed(pool, durable)} events"
            await _wait_ready(child)
            # Let it work for a random while (or until it kills itself), then SIGKILL it and start another.
            for _ in range(rnd.randint(30, 80)):
                if child.poll() is not None:
                    break
                await asyncio.sleep(0.05)
            _kill(child)
            kills += 1
            child = _start_child(urls, urls.database_url, durable, job_id, per_mille=1)
        await publisher
    finally:
        _kill(child)
        if not publisher.done():
            publisher.cancel()

    assert kills >= 3
    print(f"{kills} kills")  # noqa: T201 - shown with -s
    assert _as_logged(await _transitions(lanes, job_id)) == _as_expected(events)  # no loss, no duplicate
    expected_view, _, rejected = clean_run(events)
    async with pool.acquire() as conn:
        view = await repository.load(conn, job_id)
    assert view == expected_view
    assert len(await _events(lanes, f"lanes.job.{job_id}.transition_rejected")) == len(rejected)
    assert await _dead_letters(lanes, durable) == 0


# --- per-job optimistic concurrency ---------------------------------------------------------------


async def _wait_processed(pool: asyncpg.Pool, durable: str, count: int) -> None:
    await eventually(lambda: _count_is(pool, durable, count), timeout_s=180, what=f"{count} events on {durable}")


@pytest.mark.parametrize("topology", ["shared", "split"])
async def test_two_concurrent_lifecycle_processes_never_double_a_transition(
    lanes: LanesClient, pool: asyncpg.Pool, urls: ServerUrls, unique: str, *, second_database: str, topology: str
) -> None:
    """shared: two replicas on one durable and one database (scaling out). split: two replicas that share
    nothing but the log (separate durables and databases), the case only the JetStream check can guard."""
    job_id = f"pair-{unique}"
    events = long_story(job_id, total=600)
    if topology == "shared":
        setups = [(urls.database_url, f"pair-{unique}"), (urls.database_url, f"pair-{unique}")]
    else:
        setups = [(urls.database_url, f"pair-a-{unique}"), (second_database, f"pair-b-{unique}")]
    children = [_start_child(urls, db, durable, job_id, per_mille=0) for db, durable in setups]
    other = await _pool(second_database)
    try:
        await asyncio.gather(*(_wait_ready(c) for c in children))
        for event in events:
            await lanes.publish(event)
        for db, durable in dict.fromkeys(setups):
            target = pool if db == urls.database_url else other
            await _wait_processed(target, durable, len(events))
            # Folded is not yet published: the transitions leave through the outbox after the commit.
            await eventually(functools.partial(_all_published, target, durable), what="every transition published")
    finally:
        for child in children:
            _kill(child)

    logged = _as_logged(await _transitions(lanes, job_id))
    assert logged == _as_expected(events)
    assert len(set(logged)) == len(logged)
    expected_view, _, _ = clean_run(events)
    for db in dict.fromkeys(db for db, _ in setups):
        async with (pool if db == urls.database_url else other).acquire() as conn:
            assert await repository.load(conn, job_id) == expected_view
    await other.close()


@dataclass(frozen=True)
class _Race:
    other: asyncpg.Pool
    """The second replica's projection: its view of the job is one state change behind the log."""
    handle: Handler
    failure: RankExited
    """A rank failure, decided on that stale view."""


@contextlib.asynccontextmanager
async def _lost_race(lanes: LanesClient, pool: asyncpg.Pool, second_database: str, job_id: str) -> AsyncIterator[_Race]:
    """Two replicas (`pool` and a second database) hold the same view of a running job; the first then
    cancels it, appending a state change the second has not seen."""
    story = long_story(job_id, total=400)
    prefix = story[: next(i for i, e in enumerate(story) if e.type.endswith("heartbeat.v1")) + 1]  # running
    other = await _pool(second_database)
    handle = job_event_handler(lanes.js)
    try:
        for event in prefix:
            await lanes.publish(event)
        for db in (pool, other):
            for seq, event in enumerate(prefix, start=1):
                async with db.acquire() as conn, conn.transaction():
                    await handle(event, HandlerContext(conn, seq, 1))
        keys: dict[str, Any] = {"source": "tests", "jobid": job_id, "attempt": 1}
        cancel = CancelRequested(data=CommandData(requested_by="alice"), **keys)
        async with pool.acquire() as conn, conn.transaction():
            await handle(cancel, HandlerContext(conn, 1000, 1))
        yield _Race(other, handle, RankExited(rank=1, node="node-1", data=RankExitedData(exit_code=3), **keys))
    finally:
        await other.close()


async def test_a_writer_that_lost_the_race_is_refused_and_rolls_back(
    lanes: LanesClient, pool: asyncpg.Pool, unique: str, second_database: str
) -> None:
    """Two replicas hold the same view of a running job; one applies a cancel, the other a rank failure.
    Exactly one transition reaches the log; the other handler raises and its projection is not changed."""
    job_id = f"race-{unique}"
    async with _lost_race(lanes, pool, second_database, job_id) as race:
        with pytest.raises(TransitionConflictError, match="another writer"):
            async with race.other.acquire() as conn, conn.transaction():
                await race.handle(race.failure, HandlerContext(conn, 1001, 1))
        async with race.other.acquire() as conn:
            loser = await repository.load(conn, job_id)
    assert loser is not None
    assert loser.state is JobState.RUNNING  # rolled back with the refused publish
    assert loser.current.ranks[1].exited is False
    logged = await _transitions(lanes, job_id)
    assert logged[-1].data.to_state is JobState.CANCELLING
    assert [c.data.to_state for c in logged].count(JobState.PARTIALLY_FAILED) == 0
    assert [c.data.sequence for c in logged] == list(range(1, len(logged) + 1))


async def test_a_batch_appends_its_state_changes_at_its_end_and_settles_a_lost_race_event_by_event(
    lanes: LanesClient, pool: asyncpg.Pool, unique: str, second_database: str
) -> None:
    """In a batch, state changes wait for the batch's end (every job's chain at once). A race lost there rolls
    the batch back; folded again event by event (an isolated scope), only the loser is refused, and the
    winner adopts the state change the rolled-back batch had already appended instead of appending another."""
    raced, fresh = f"race-{unique}", f"fresh-{unique}"
    submitted = long_story(fresh, total=400)[0]
    async with _lost_race(lanes, pool, second_database, raced) as race:
        batch = TransactionScope(deferred=True, keys=frozenset({raced, fresh}))
        async with race.other.acquire() as conn:
            transaction = conn.transaction()
            await transaction.start()
            await race.handle(submitted, HandlerContext(conn, 1001, 1, batch))
            await race.handle(race.failure, HandlerContext(conn, 1002, 1, batch))
            assert await _transitions(lanes, fresh) == []  # nothing appended before the batch's end
            with pytest.raises(TransitionConflictError, match="another writer"):
                await batch.flush()
            await transaction.rollback()  # as the consumer does when the flush fails
        async with race.other.acquire() as conn:
            assert await repository.load(conn, fresh) is None  # the whole batch rolled back
        assert len(await _transitions(lanes, fresh)) == 1  # its chain ran to its end before the failure

        one_by_one = TransactionScope(deferred=True, isolated=True, keys=frozenset({raced, fresh}))
        async with race.other.acquire() as conn, conn.transaction():
            await race.handle(submitted, HandlerContext(conn, 1001, 1, one_by_one))
            with pytest.raises(TransitionConflictError):
                async with conn.transaction():
                    await race.handle(race.failure, HandlerContext(conn, 1002, 1, one_by_one))
            await one_by_one.flush()
        async with race.other.acquire() as conn:
            view, transition_seq = await repository.load_with_seq(conn, fresh)
            loser = await repository.load(conn, raced)
    (appended,) = await _transitions(lanes, fresh)  # adopted, not appended twice
    assert view is not None
    assert view.state is appended.data.to_state
    assert transition_seq == (await lanes.js.get_last_msg(JOBS.name, f"lanes.job.{fresh}.state_changed")).seq
    assert loser is not None
    assert loser.state is JobState.RUNNING


@pytest.mark.slow
async def test_two_replicas_killed_at_random_during_50_interleaved_jobs_leave_a_projection_equal_to_a_clean_fold(
    own_urls: ServerUrls, unique: str
) -> None:
    """Each job's events are applied in stream order across replicas and crashes (docs/ordering.md): two
    replicas share the durable, one of them is SIGKILLed at random instants while 50 jobs' stories arrive
    interleaved, and `lanes projections rebuild --verify` then finds the live projection equal to the fold."""
    durable = f"pair50-{unique}"
    stories = [long_story(f"j{i}-{unique}", total=40) for i in range(50)]
    interleaved = [story[k] for k in range(40) for story in stories]
    rnd = random.Random(unique)  # noqa: S311 - reproducible kill times per run id
    db = await create_pool(own_urls.database_url)
    lanes = await LanesClient.connect(own_urls.nats_url, source="tests")
    await provision_streams(lanes.js)
    await apply_runtime_migrations(db)
    assert SERVICE.migrations is not None
    await apply_migrations(db, "lifecycle", SERVICE.migrations)  # before the replicas, whose stdout says "ready"

    def start() -> subprocess.Popen[str]:
        return _start_child(own_urls, own_urls.database_url, durable, "*", per_mille=0)

    replicas = [start(), start()]
    try:
        await asyncio.gather(*(_wait_ready(r) for r in replicas))
        publisher = asyncio.create_task(_publish_all(lanes, interleaved))
        # Kills at random points of the burst, chosen by progress rather than by time, so a fast or a slow
        # machine sees the same number of them, each while events are still being folded.
        kill_points = sorted(rnd.sample(range(len(interleaved) // 10, len(interleaved) * 9 // 10), 3))
        for point in kill_points:
            await eventually(functools.partial(_count_is, db, durable, point), timeout_s=120, what=f"{point} folded")
            victim = rnd.randrange(2)
            _kill(replicas[victim])
            replicas[victim] = start()
            await _wait_ready(replicas[victim])
        await _wait_processed(db, durable, len(interleaved))
        await publisher
    finally:
        for replica in replicas:
            _kill(replica)
        await lanes.close()
        await db.close()
    result = await run_lanes_async(own_urls, "projections", "rebuild", "--verify")
    assert result.returncode == 0, result.stdout + result.stderr


async def _publish_all(lanes: LanesClient, events: list[Event]) -> None:
    for event in events:
        await lanes.publish(event)


# --- the projection's writes ---------------------------------------------------------------------


async def _rows(pool: asyncpg.Pool, job_id: str) -> dict[str, list[tuple[Any, ...]]]:
    rows = {}
    for table in repository.PROJECTION_TABLES:
        fetched = await pool.fetch(f"SELECT * FROM {table} WHERE job_id = $1", job_id)  # noqa: S608 - constant names
        rows[table] = sorted(
            tuple(v for k, v in r.items() if k not in {"updated_at", "revision", "view"}) for r in fetched
        )
    return rows


async def test_views_saved_as_changes_hold_the_same_rows_as_views_saved_whole_and_a_foreign_write_is_reread(
    pool: asyncpg.Pool,
) -> None:
    events = long_story(f"diff-{uuid.uuid4().hex[:8]}", total=300)
    job_id = str(events[0].jobid)
    whole_id = f"{job_id}-whole"
    parsed = repository.ParsedViews()
    view = None
    for event in events:  # one transaction per event, each writing only what changed since its read
        async with pool.acquire() as conn, conn.transaction():
            loaded = await repository.load_many(conn, [job_id], parsed)
            before = loaded[job_id][0] if loaded else None
            assert before == view  # from the cache or parsed again: the view last written either way
            try:
                view, _ = evolve(before, event)
            except IllegalTransitionError:
                continue  # the story's strays: rejected, nothing written
            saved = repository.SavedView(view, before=before, known_before=True)
            await repository.save_many(conn, [saved], parsed)
            whole = view.model_copy(update={"job_id": whole_id})
            await repository.save(conn, whole)  # every row replaced
    assert view is not None
    assert len(view.attempts) > 1  # the story retries: attempts, ranks and spans were all rewritten over time
    diffed, replaced = await _rows(pool, job_id), await _rows(pool, whole_id)
    for table in repository.PROJECTION_TABLES:
        assert [row[1:] for row in diffed[table]] == [row[1:] for row in replaced[table]], table

    # Another writer (a replica, a rebuild) stores a different view: the held one is not taken for it.
    foreign = view.model_copy(update={"wait_reason": "written elsewhere"})
    async with pool.acquire() as conn:
        await repository.save(conn, foreign)
    async with pool.acquire() as conn, conn.transaction():
        assert (await repository.load_many(conn, [job_id], parsed))[job_id][0] == foreign

    # A write that rolls back leaves the stored view as it was, whatever this process held for it.
    async with pool.acquire() as conn:
        transaction = conn.transaction()
        await transaction.start()
        rolled_back = foreign.model_copy(update={"wait_reason": "never committed"})
        await repository.save_many(conn, [repository.SavedView(rolled_back)], parsed)
        await transaction.rollback()
    async with pool.acquire() as conn, conn.transaction():
        assert (await repository.load_many(conn, [job_id], parsed))[job_id][0] == foreign

    # A row written before revisions existed has none: it is sent and parsed, never taken for a held one.
    await pool.execute("UPDATE lifecycle_jobs SET revision = NULL WHERE job_id = $1", job_id)
    async with pool.acquire() as conn, conn.transaction():
        assert (await repository.load_many(conn, [job_id], parsed))[job_id][0] == foreign

    # Views held when a read begins are used even if parsing the others evicts them meanwhile.
    small = repository.ParsedViews(capacity=1)
    async with pool.acquire() as conn, conn.transaction():
        await repository.load_many(conn, [whole_id], small)  # held: the whole job's view
        both = await repository.load_many(conn, [job_id, whole_id], small)  # parsing job_id evicts it
    assert both[job_id][0] == foreign
    assert both[whole_id][0].job_id == whole_id
