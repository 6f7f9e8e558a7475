"""The processing guarantees of docs/architecture.md, on real NATS JetStream and PostgreSQL servers."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import asyncpg
import pytest
from nats.js.errors import APIError, NotFoundError
from prometheus_client import REGISTRY
from support.cli import run_lanes_async
from support.contract import EFFECTS_DDL, effects, record_effect, spec_for, stored, submission
from support.logs import OUTAGE_BEGAN, json_logs
from support.waiting import eventually

from lanes_contract.client import LanesClient, connect_nats
from lanes_contract.errors import InvalidEventError, PoisonEventError
from lanes_contract.events import Event, JobSubmitted
from lanes_contract.streams import DEAD, JOBS, provision_streams
from lanes_runtime.consumer import EventConsumer, HandlerContext, Outcome, prune_processed
from lanes_runtime.delivery import DEAD_CONSUMER, DEAD_REASON, DEAD_SEQUENCE, DEAD_STREAM, ORIGINAL_MSG_ID
from lanes_runtime.health import PROBE_TIMEOUT_S
from lanes_runtime.metrics import serve_metrics
from lanes_runtime.settings import ServerUrls
from lanes_runtime.store import apply_runtime_migrations, create_pool

pytestmark = pytest.mark.real_servers


@pytest.fixture
async def pool(urls: ServerUrls) -> AsyncIterator[asyncpg.Pool]:
    db = await create_pool(urls.database_url)
    await apply_runtime_migrations(db)
    await db.execute(EFFECTS_DDL)
    yield db
    await db.close()


async def _running(consumer: EventConsumer) -> tuple[asyncio.Event, asyncio.Task[None]]:
    stop = asyncio.Event()
    return stop, asyncio.create_task(consumer.run(stop))


async def _stop(stop: asyncio.Event, task: asyncio.Task[None]) -> None:
    stop.set()
    await asyncio.wait_for(task, timeout=10)


async def _dead_letters(lanes: LanesClient, durable: str) -> list[tuple[dict[str, str], bytes]]:
    subject = f"lanes.dead.{JOBS.name}.{durable}"
    if await stored(lanes.js, DEAD.name, subject) == 0:
        return []
    sub = await lanes.js.subscribe(subject, stream=DEAD.name, ordered_consumer=True)
    letters = []
    while True:
        msg = await sub.next_msg(timeout=5)
        letters.append((dict(msg.headers or {}), msg.data))
        if msg.metadata.num_pending == 0:
            break
    await sub.unsubscribe()
    return letters


async def test_a_resent_event_is_stored_once(lanes: LanesClient, unique: str) -> None:
    event = submission(f"dup-{unique}")
    first = await lanes.publish(event)
    second = await lanes.publish(event)
    assert second == first
    assert await stored(lanes.js, JOBS.name, event.nats_subject()) == 1


async def test_an_invalid_event_is_refused_before_sending(lanes: LanesClient, unique: str) -> None:
    good = submission(f"bad-{unique}")
    broken = good.model_copy(update={"jobid": "has.dots"})  # model_copy skips validation
    with pytest.raises(InvalidEventError, match="jobid"):
        await lanes.publish(broken)
    info = await lanes.js.stream_info(JOBS.name, subjects_filter="lanes.job.has.>")
    assert not info.state.subjects


async def test_an_event_is_processed_once_and_its_output_published(
    lanes: LanesClient, pool: asyncpg.Pool, unique: str
) -> None:
    job_id = f"once-{unique}"
    consumer = EventConsumer(lanes._nc, pool, spec_for(job_id), record_effect)
    stop, task = await _running(consumer)
    event = submission(job_id)
    await lanes.publish(event)
    await lanes.publish(event)  # de-duplicated by JetStream
    await eventually(lambda: _processed(consumer, 1), what="processing")
    await _stop(stop, task)
    assert await effects(pool, event.id) == 1
    assert await stored(lanes.js, JOBS.name, f"lanes.job.{job_id}.waiting") == 1


async def test_batches_in_flight_are_processed_side_by_side_and_each_once(
    lanes: LanesClient, pool: asyncpg.Pool, unique: str
) -> None:
    """With two batches in flight, the second is in its handler before the first leaves its own."""
    job_id = f"flight-{unique}"
    entered: list[str] = []
    both_entered = asyncio.Event()

    async def meeting(event: Event, ctx: HandlerContext) -> Sequence[Event]:
        entered.append(event.id)
        if len(entered) == 2:
            both_entered.set()
        # With one batch at a time, the first would wait here in vain and the second never come.
        await asyncio.wait_for(both_entered.wait(), timeout=10)
        return await record_effect(event, ctx)

    consumer = EventConsumer(lanes._nc, pool, spec_for(job_id, batch=1, in_flight=2), meeting)
    events = [submission(job_id), submission(job_id)]
    for event in events:
        await lanes.publish(event)
    stop, task = await _running(consumer)
    await eventually(lambda: _processed(consumer, 2), what="both batches")
    await _stop(stop, task)
    assert sorted(entered) == sorted(event.id for event in events)
    assert consumer.outcomes[Outcome.RETRY] == 0
    assert [await effects(pool, event.id) for event in events] == [1, 1]
    assert await stored(lanes.js, JOBS.name, f"lanes.job.{job_id}.waiting") == 2


async def _processed(consumer: EventConsumer, count: int) -> bool:
    return consumer.outcomes[Outcome.PROCESSED] >= count


@pytest.mark.parametrize("point", ["ack", "publish"])
async def test_a_crash_after_commit_does_the_effect_exactly_once(
    lanes: LanesClient, pool: asyncpg.Pool, urls: ServerUrls, unique: str, point: str
) -> None:
    job_id = f"crash-{point}-{unique}"
    event = submission(job_id)
    await lanes.publish(event)
    child = Path(__file__).parent / "crash_consumer.py"
    result = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(child), urls.nats_url, urls.database_url, job_id, point],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == -9, result.stderr.decode()[-2000:]  # killed by its own SIGKILL
    assert await effects(pool, event.id) == 1  # the transaction committed before the crash
    outbox = await pool.fetchval("SELECT count(*) FROM lanes_outbox WHERE cause_id = $1", event.id)
    assert outbox == (1 if point == "publish" else 0)

    consumer = EventConsumer(lanes._nc, pool, spec_for(job_id), record_effect)
    stop, task = await _running(consumer)  # the unacknowledged message comes back after ack_wait
    await eventually(lambda: _settled(consumer), what="redelivery after the crash")
    await _stop(stop, task)
    assert consumer.outcomes[Outcome.DUPLICATE] == 1
    assert consumer.outcomes[Outcome.PROCESSED] == 0
    assert await effects(pool, event.id) == 1
    assert await stored(lanes.js, JOBS.name, f"lanes.job.{job_id}.waiting") == 1
    assert await pool.fetchval("SELECT count(*) FROM lanes_outbox WHERE cause_id = $1", event.id) == 0


async def _settled(consumer: EventConsumer) -> bool:
    return consumer.outcomes[Outcome.DUPLICATE] + consumer.outcomes[Outcome.PROCESSED] >= 1


async def test_a_poison_message_is_dead_lettered_and_the_consumer_keeps_going(
    lanes: LanesClient, pool: asyncpg.Pool, unique: str
) -> None:
    job_id = f"poison-{unique}"
    spec = spec_for(job_id)
    consumer = EventConsumer(lanes._nc, pool, spec, record_effect)
    stop, task = await _running(consumer)
    subject = f"lanes.job.{job_id}.submitted"
    ack = await lanes.js.publish(
        subject, b"{not json", headers={"ce-specversion": "1.0", "ce-type": "x", "Nats-Msg-Id": f"junk-{unique}"}
    )
    good = submission(job_id)
    await lanes.publish(good)
    await eventually(lambda: _processed(consumer, 1), what="the valid event after the poison one")
    await _stop(stop, task)

    assert consumer.outcomes[Outcome.DEAD_LETTERED] == 1
    assert await effects(pool, good.id) == 1
    (headers, payload), *rest = await _dead_letters(lanes, spec.durable)
    assert not rest
    assert payload == b"{not json"
    assert headers[DEAD_SEQUENCE] == str(ack.seq)
    assert headers[DEAD_STREAM] == JOBS.name
    assert headers[DEAD_CONSUMER] == spec.durable
    assert "not valid JSON" in headers[DEAD_REASON]
    assert headers["ce-type"] == "x"  # the original headers travel with it
    assert headers[ORIGINAL_MSG_ID] == f"junk-{unique}"


async def test_an_invariant_violation_is_dead_lettered_at_once(
    lanes: LanesClient, pool: asyncpg.Pool, unique: str
) -> None:
    async def refuse(event: Event, ctx: HandlerContext) -> list[Event]:
        await ctx.conn.execute("INSERT INTO effects (event_id) VALUES ($1)", event.id)
        raise PoisonEventError("job is in a state that forbids this")

    job_id = f"invariant-{unique}"
    spec = spec_for(job_id)
    consumer = EventConsumer(lanes._nc, pool, spec, refuse)
    stop, task = await _running(consumer)
    event = submission(job_id)
    await lanes.publish(event)
    await eventually(lambda: _dead(consumer), what="dead letter")
    await _stop(stop, task)
    assert await effects(pool, event.id) == 0  # the transaction was rolled back
    ((headers, _),) = await _dead_letters(lanes, spec.durable)
    assert "forbids this" in headers[DEAD_REASON]
    assert headers["Lanes-Dead-Deliveries"] == "1"


async def _dead(consumer: EventConsumer) -> bool:
    return consumer.outcomes[Outcome.DEAD_LETTERED] >= 1


async def test_a_transient_postgres_error_is_redelivered_not_lost(
    lanes: LanesClient, pool: asyncpg.Pool, unique: str
) -> None:
    deliveries: list[int] = []

    async def flaky(event: Event, ctx: HandlerContext) -> list[Event]:
        deliveries.append(ctx.deliveries)
        if len(deliveries) == 1:
            # A real server-side failure: the database ends this session in the middle of the transaction.
            await ctx.conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        return list(await record_effect(event, ctx))

    job_id = f"transient-{unique}"
    consumer = EventConsumer(lanes._nc, pool, spec_for(job_id), flaky)
    stop, task = await _running(consumer)
    event = submission(job_id)
    await lanes.publish(event)
    await eventually(lambda: _processed(consumer, 1), what="processing after the transient error")
    await _stop(stop, task)
    # An unreachable database says nothing about the event: the batch is held and tried again in place,
    # without spending a delivery.
    assert deliveries == [1, 1]
    assert consumer.outcomes[Outcome.HELD] == 1
    assert consumer.outcomes[Outcome.RETRY] == 0
    assert await effects(pool, event.id) == 1
    assert await stored(lanes.js, JOBS.name, f"lanes.job.{job_id}.waiting") == 1


async def test_the_batch_fetched_ahead_is_kept_in_progress_through_an_outage(
    lanes: LanesClient, pool: asyncpg.Pool, unique: str
) -> None:
    """A consumer fetches its next batch while it works on one. If an outage holds the batch at work, the one
    fetched ahead is kept in progress too: a second replica does not get it redelivered, no delivery is spent.
    """
    job_id = f"ahead-{unique}"
    spec = spec_for(job_id, batch=4)
    down = True
    seen: list[tuple[str, int, str]] = []

    def handler(replica: str) -> Callable[[Event, HandlerContext], Awaitable[Sequence[Event]]]:
        async def handle(event: Event, ctx: HandlerContext) -> Sequence[Event]:
            if down:
                raise ConnectionRefusedError("database down")
            seen.append((replica, ctx.deliveries, event.id))
            return await record_effect(event, ctx)

        return handle

    events = [submission(job_id) for _ in range(2 * spec.batch)]
    for event in events:
        await lanes.publish(event)
    first = EventConsumer(lanes._nc, pool, spec, handler("first"))
    stop_first, first_task = await _running(first)
    await eventually(lambda: _held(first), what="the first replica holding its batch through the outage")
    second = EventConsumer(lanes._nc, pool, spec, handler("second"))
    stop_second, second_task = await _running(second)
    await asyncio.sleep(2.5 * spec.ack_wait_s)  # long enough for an unattended delivery to time out twice
    down = False

    async def all_processed() -> bool:
        return {event_id for _, _, event_id in seen} == {event.id for event in events}

    await eventually(all_processed, what="both batches processed after the outage")
    await _stop(stop_second, second_task)
    await _stop(stop_first, first_task)
    assert len(seen) == len(events)  # each once
    assert {(replica, deliveries) for replica, deliveries, _ in seen} == {("first", 1)}
    assert first.outcomes[Outcome.RETRY] == 0
    assert second.outcomes.total() == 0
    assert await _dead_letters(lanes, spec.durable) == []


async def _held(consumer: EventConsumer) -> bool:
    return consumer.outcomes[Outcome.HELD] > 0


async def test_a_message_that_always_fails_is_dead_lettered_after_max_deliver(
    lanes: LanesClient, pool: asyncpg.Pool, unique: str
) -> None:
    async def broken(event: Event, ctx: HandlerContext) -> list[Event]:
        raise RuntimeError("dependency keeps failing")

    job_id = f"maxdeliver-{unique}"
    spec = spec_for(job_id, max_deliver=3)
    consumer = EventConsumer(lanes._nc, pool, spec, broken)
    stop, task = await _running(consumer)
    await lanes.publish(submission(job_id))
    await eventually(lambda: _dead(consumer), what="dead letter after max deliveries")
    await _stop(stop, task)
    assert consumer.outcomes[Outcome.RETRY] == 2
    ((headers, _),) = await _dead_letters(lanes, spec.durable)
    assert "gave up after 3 deliveries" in headers[DEAD_REASON]
    assert "dependency keeps failing" in headers[DEAD_REASON]


async def test_provisioning_twice_is_a_no_op(lanes: LanesClient, pool: asyncpg.Pool, unique: str) -> None:
    await provision_streams(lanes.js)
    assert set((await provision_streams(lanes.js)).values()) == {"unchanged"}
    consumer = EventConsumer(lanes._nc, pool, spec_for(f"prov-{unique}"), record_effect)
    await consumer.provision()
    before = await lanes.js.consumer_info(JOBS.name, consumer.spec.durable)
    await consumer.provision()
    after = await lanes.js.consumer_info(JOBS.name, consumer.spec.durable)
    assert before.config == after.config
    assert await apply_runtime_migrations(pool) == []


async def test_the_max_deliveries_advisory_dead_letters_an_abandoned_message(
    lanes: LanesClient, pool: asyncpg.Pool, unique: str
) -> None:
    job_id = f"abandoned-{unique}"
    spec = spec_for(job_id, max_deliver=1, ack_wait_s=1.0)
    consumer = EventConsumer(lanes._nc, pool, spec, record_effect)
    await consumer.provision()
    # A process that fetched the message and died: never acknowledged, no more deliveries allowed.
    sub = await lanes.js.pull_subscribe_bind(spec.durable, stream=JOBS.name)
    await lanes.publish(submission(job_id))
    (abandoned,) = await sub.fetch(1, timeout=5)
    assert abandoned.metadata.num_delivered == 1
    stop, task = await _running(consumer)  # listens for the advisory
    await eventually(lambda: _has_dead_letter(lanes, spec.durable), what="dead letter from the advisory")
    await _stop(stop, task)
    ((headers, _),) = await _dead_letters(lanes, spec.durable)
    assert "max deliveries reached without a decision" in headers[DEAD_REASON]
    assert headers[DEAD_SEQUENCE] == str(abandoned.metadata.sequence.stream)


async def _has_dead_letter(lanes: LanesClient, durable: str) -> bool:
    return await stored(lanes.js, DEAD.name, f"lanes.dead.{JOBS.name}.{durable}") > 0


async def test_the_producer_api_in_three_lines(urls: ServerUrls, unique: str) -> None:
    async with await LanesClient.connect(urls.nats_url, source="agent/node-17") as lanes:
        await provision_streams(lanes.js)
        seq = await lanes.publish(submission(f"three-{unique}"))
    assert seq > 0
    nc = await connect_nats(urls.nats_url, name="tests")
    msg = await nc.jetstream().get_msg(JOBS.name, seq)
    await nc.close()
    assert msg.headers is not None
    assert msg.headers["ce-type"] == JobSubmitted.model_fields["type"].default
    assert json.loads(msg.data or b"{}")["spec"]["name"] == "t"


async def test_two_writers_cannot_both_append_after_the_same_job_state(lanes: LanesClient, unique: str) -> None:
    job_id = f"occ-{unique}"
    job_subjects = f"lanes.job.{job_id}.>"
    first = await lanes.publish(submission(job_id), expected_last_subject_seq=0, expected_subject=job_subjects)
    # Both writers read the job at `first`; the first append wins, the second is refused by the server.
    winner = await lanes.publish(submission(job_id), expected_last_subject_seq=first, expected_subject=job_subjects)
    with pytest.raises(APIError, match="wrong last sequence"):
        await lanes.publish(submission(job_id), expected_last_subject_seq=first, expected_subject=job_subjects)
    assert winner > first
    assert await stored(lanes.js, JOBS.name, f"lanes.job.{job_id}.submitted") == 2


async def test_processed_records_stay_bounded_and_a_redelivery_inside_the_window_is_still_recognised(
    lanes: LanesClient, pool: asyncpg.Pool, unique: str
) -> None:
    job_id = f"prune-{unique}"
    spec = spec_for(job_id, ack_wait_s=1.0)
    consumer = EventConsumer(lanes._nc, pool, spec, record_effect)
    await consumer.provision()
    sub = await lanes.js.pull_subscribe_bind(spec.durable, stream=JOBS.name)
    event = submission(job_id)
    await lanes.publish(event)
    (first,) = await sub.fetch(1, timeout=10)

    async def lost() -> None:  # the acknowledgement never reaches the server
        return None

    first.ack = lost  # type: ignore[method-assign]
    await consumer.process_batch([first])
    assert consumer.outcomes[Outcome.PROCESSED] == 1

    # A million records from long ago, as a busy consumer leaves them behind.
    await pool.execute(
        """INSERT INTO lanes_processed (consumer, event_id, stream, stream_seq, processed_at)
           SELECT $1, 'old-' || n, 'LANES_JOBS', n, now() - interval '1 day' FROM generate_series(1, 1000000) AS n""",
        spec.durable,
    )
    assert await prune_processed(pool, spec.durable, spec.retention_s) == 1_000_000
    left = await pool.fetchval("SELECT count(*) FROM lanes_processed WHERE consumer = $1", spec.durable)
    assert left == 1  # only the record inside the retention window

    (again,) = await sub.fetch(1, timeout=10)  # redelivered after ack_wait
    assert again.metadata.num_delivered == 2
    await consumer.process_batch([again])
    assert consumer.outcomes[Outcome.DUPLICATE] == 1
    assert await effects(pool, event.id) == 1
    await sub.unsubscribe()


async def test_lanes_dead_replay_re_drives_a_dead_letter_after_a_fix_and_nothing_doubles(
    lanes: LanesClient, pool: asyncpg.Pool, urls: ServerUrls, unique: str
) -> None:
    broken = True

    async def until_fixed(event: Event, ctx: HandlerContext) -> list[Event]:
        if broken:
            raise PoisonEventError("a bug, fixed by the next deploy")
        return list(await record_effect(event, ctx))

    job_id = f"replay-{unique}"
    spec = spec_for(job_id)
    consumer = EventConsumer(lanes._nc, pool, spec, until_fixed)
    stop, task = await _running(consumer)
    event = submission(job_id)
    await lanes.publish(event)
    await eventually(lambda: _dead(consumer), what="dead letter")
    broken = False  # the fix

    listed = await run_lanes_async(urls, "dead", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    (letter,) = [json.loads(line) for line in listed.stdout.splitlines() if spec.durable in line]
    assert letter["event_id"] == event.id
    assert "fixed by the next deploy" in letter["reason"]
    for _ in range(2):  # a second replay of the same letter publishes nothing new
        replayed = await run_lanes_async(urls, "dead", "replay", str(letter["dead_seq"]))
        assert replayed.returncode == 0, replayed.stderr
    await eventually(lambda: _processed(consumer, 1), what="the replayed event processed")
    await _stop(stop, task)
    assert await effects(pool, event.id) == 1
    assert await stored(lanes.js, JOBS.name, event.nats_subject()) == 2  # the original and one replay


async def test_metrics_endpoint_shows_the_consumer_counters_and_histograms_without_job_labels(
    lanes: LanesClient, pool: asyncpg.Pool, unique: str
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    serve_metrics(port, host="127.0.0.1")
    job_id = f"metrics-{unique}"
    consumer = EventConsumer(lanes._nc, pool, spec_for(job_id), record_effect)
    stop, task = await _running(consumer)
    await lanes.publish(submission(job_id))
    await eventually(lambda: _processed(consumer, 1), what="processing")
    await _stop(stop, task)
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode())
    durable = consumer.spec.durable
    assert f'lanes_consumer_events_total{{consumer="{durable}",outcome="processed"}} 1.0' in body
    for family in ("lanes_consumer_batch_size", "lanes_consumer_handler_seconds", "lanes_consumer_commit_seconds"):
        assert f'{family}_count{{consumer="{durable}"}}' in body
    assert f'lanes_consumer_ready{{consumer="{durable}"}} 1.0' in body
    assert f'lanes_consumer_pending{{consumer="{durable}"}}' in body
    assert "job=" not in body  # labelled by consumer, never by job
    assert "job_id=" not in body


async def test_an_ordered_fold_settles_a_failing_event_alone_and_counts_each_event_once(
    lanes: LanesClient, pool: asyncpg.Pool, unique: str
) -> None:
    # The fold's fast pass has no savepoint per event: the failure rolls the whole batch back, and the batch
    # is folded again with savepoints. Nothing the rolled-back pass did may survive: effects or counts.
    jobs = [f"fold-{name}-{unique}" for name in ("a", "b", "c")]
    events = [submission(job) for _ in range(2) for job in jobs]
    poison = events[4]  # job b's second event, with events of every job before and after it

    async def apply(event: Event, ctx: HandlerContext) -> list[Event]:
        await ctx.conn.execute("INSERT INTO effects (event_id) VALUES ($1)", event.id)
        if event.id == poison.id:
            raise PoisonEventError("this event may never be applied")
        return []

    spec = spec_for(jobs[0], subjects=tuple(f"lanes.job.{job}.submitted" for job in jobs), ordered=True)
    consumer = EventConsumer(lanes._nc, pool, spec, apply)
    await consumer.provision()
    for event in events:
        await lanes.publish(event)
    stop, task = await _running(consumer)
    await eventually(lambda: _processed(consumer, 5), what="the five good events folded")
    await eventually(lambda: _dead(consumer), what="the failing event dead-lettered")
    await _stop(stop, task)

    assert consumer.outcomes[Outcome.PROCESSED] == 5
    assert consumer.outcomes[Outcome.DEAD_LETTERED] == 1
    assert [await effects(pool, event.id) for event in events] == [1, 1, 1, 1, 0, 1]
    ((headers, _),) = await _dead_letters(lanes, spec.durable)
    assert "may never be applied" in headers[DEAD_REASON]


def _ready_gauge(consumer: str) -> float | None:
    return REGISTRY.get_sample_value("lanes_consumer_ready", {"consumer": consumer})


async def test_an_idle_consumer_is_ready_from_its_start_and_its_gauge_says_so(
    lanes: LanesClient, pool: asyncpg.Pool, unique: str
) -> None:
    # A restarted process has a fresh gauge; it used to read 0 until a batch went through.
    consumer = EventConsumer(lanes._nc, pool, spec_for(f"idle-{unique}"), record_effect)
    assert consumer.ready
    assert _ready_gauge(consumer.name) == 1.0
    stop, task = await _running(consumer)

    async def idle_and_waiting_for_messages() -> bool:
        try:
            info = await lanes.js.consumer_info(JOBS.name, consumer.name)
        except NotFoundError:
            return False
        return bool(info.num_waiting)  # its fetch waits on the server: the loop runs, with nothing to do

    await eventually(idle_and_waiting_for_messages, what="the idle consumer's fetch waiting")
    assert consumer.ready
    assert _ready_gauge(consumer.name) == 1.0
    await _stop(stop, task)
    assert consumer.outcomes == {}


async def test_a_consumer_that_fails_is_not_ready_for_good(lanes: LanesClient, pool: asyncpg.Pool, unique: str) -> None:
    missing = dataclasses.replace(JOBS, name=f"NO_SUCH_STREAM_{unique}")
    consumer = EventConsumer(lanes._nc, pool, spec_for(f"failing-{unique}", stream=missing), record_effect)
    assert consumer.ready
    with pytest.raises(NotFoundError):
        await consumer.run(asyncio.Event())
    assert not consumer.ready
    assert _ready_gauge(consumer.name) == 0.0


async def test_a_slow_but_healthy_batch_is_no_outage(
    lanes: LanesClient, pool: asyncpg.Pool, unique: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The batch's transaction takes twice the database probe's timeout; the server answers the probe meanwhile.
    slow_s = 2 * PROBE_TIMEOUT_S

    async def slow(event: Event, ctx: HandlerContext) -> list[Event]:
        await ctx.conn.execute("SELECT pg_sleep($1)", slow_s)
        return list(await record_effect(event, ctx))

    job_id = f"slow-{unique}"
    consumer = EventConsumer(lanes._nc, pool, spec_for(job_id, ack_wait_s=30.0), slow)
    with json_logs(capsys) as logs:
        stop, task = await _running(consumer)
        event = submission(job_id)
        await lanes.publish(event)
        await eventually(lambda: _processed(consumer, 1), timeout_s=slow_s + 20, what="the slow batch processed")
        await _stop(stop, task)
        assert not [line for line in logs.about(consumer.name) if line["event"] == OUTAGE_BEGAN]
    assert consumer.ready
    assert await effects(pool, event.id) == 1
