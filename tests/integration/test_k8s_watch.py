"""The list+watch loop against an API server that speaks the watch protocol over real HTTP (support.k8s_api).

Each test feeds the cluster's changes one at a time and waits until the observer has read each, so the
mapping sees them in the cluster's order; then it compares what the observer put in its outbox with what the
pure mapping makes of the same stream. Faults: a 410 Gone in the middle of a stream (an ERROR event) and as
the HTTP status, dropped connections, slow streams cut mid-line, the server away and back, and a restart of
the observer from its state file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Self

import pytest
from support.k8s_api import PLURAL_OF, FakeKubeApi
from support.waiting import eventually

from lanes_contract.codec import decode_structured
from lanes_contract.events import Event, JobPlaced, RankExited, RetryRequested
from lanes_k8s.kubeconfig import ApiAccess
from lanes_k8s.mapping import Observer
from lanes_k8s.watch import Backoff, KubeApi, KubeWatch
from lanes_observe.outbox import Outbox, Sender

DATA = Path(__file__).resolve().parents[1] / "data" / "k8s"
NAMESPACED_KINDS = {"Workload", "Pod", "Event"}


def stream(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


def pure(watch_events: list[dict[str, Any]]) -> list[str]:
    observer = Observer()
    ids: list[str] = []
    for item in watch_events:
        ids.extend(e.id for e in observer.apply(item["object"]["kind"], item["type"], item["object"]))
    return ids


@pytest.fixture
async def api() -> AsyncIterator[FakeKubeApi]:
    server = FakeKubeApi()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


class Running:
    """A KubeWatch running in a task, with its outbox (no NATS: the outbox keeps all it was given)."""

    def __init__(self, api: FakeKubeApi, tmp_path: Path, *, state_file: Path | None = None, namespaces=()) -> None:
        self.outbox = Outbox(tmp_path / "k8s-outbox.ndjson")
        self.watch = KubeWatch(
            KubeApi(ApiAccess(server=api.url), read_timeout_s=10.0),
            self.outbox,
            Sender(self.outbox, None, name="tests-k8s"),
            namespaces=namespaces,
            state_file=state_file,
            watch_timeout_s=3,
            save_every_s=0.0,
            backoff=Backoff(initial_s=0.05, cap_s=0.3),
        )
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        self.task = asyncio.create_task(self.watch.run(self.stop))
        return self

    async def __aexit__(self, *_exc: object) -> None:
        self.stop.set()
        assert self.task is not None
        await self.task
        await self.watch.api.close()

    def events(self) -> list[Event]:
        return [decode_structured(line) for line in self.outbox.lines()]

    def ids(self) -> list[str]:
        return [e.id for e in self.events()]

    def version_of(self, kind: str) -> int:
        versions = [int(s.resource_version or 0) for key, s in self.watch.streams.items() if key.startswith(f"{kind}:")]
        return min(versions) if versions else 0


async def feed(api: FakeKubeApi, running: Running, items: list[dict[str, Any]]) -> None:
    """Each change in turn, waiting until the observer's watch of that kind has read past it."""
    for item in items:
        version = await api.apply(item["type"], item["object"])
        kind = item["object"]["kind"]

        async def absorbed(kind: str = kind, version: int = version) -> bool:
            return running.version_of(kind) >= version

        await eventually(absorbed, timeout_s=20, what=f"{kind} at resourceVersion {version} read")


async def until(check: Callable[[], bool], what: str) -> None:
    async def holds() -> bool:
        return check()

    await eventually(holds, timeout_s=20, what=what)


def no_duplicate_facts(events: list[Event]) -> None:
    ids = Counter(e.id for e in events)
    assert [i for i, n in ids.items() if n > 1] == []
    facts = Counter((e.type, e.jobid, e.attempt, e.node, e.rank, e.data.model_dump_json()) for e in events)
    assert [f for f, n in facts.items() if n > 1] == []


async def test_list_then_watch_publishes_what_the_mapping_makes_of_the_stream(api, tmp_path):
    items = stream("kueue-podsreadytimeout.ndjson")
    await api.apply(items[0]["type"], items[0]["object"])  # there before the observer starts: listed
    async with Running(api, tmp_path) as running:
        await until(lambda: running.watch.ready, "the watch ready")
        await feed(api, running, items[1:])
        await until(lambda: running.ids() == pure(items), "every event of the stream")
    assert api.list_requests("workloads")
    watch = api.watch_requests("workloads")[0]
    assert watch["allowWatchBookmarks"] == "true"
    assert watch["resourceVersion"] == "1001"


@pytest.mark.parametrize("as_status", [False, True], ids=["error-event", "http-status"])
async def test_a_410_gone_relists_and_publishes_no_event_twice(api, tmp_path, as_status):
    items = stream("kueue-podsreadytimeout.ndjson")
    async with Running(api, tmp_path) as running:
        await until(lambda: running.watch.ready, "the watch ready")
        await feed(api, running, items[:6])
        relists = running.watch.relists
        if as_status:  # away while two changes happen and the history is compacted: the watch asks too old a version
            await api.stop()
            for item in items[6:8]:
                await api.apply(item["type"], item["object"])
            api.compact()
            api.faults.gone_as_status = True
            await api.start()
        else:  # mid-stream: after one more event the server says ERROR 410 and compacts
            api.faults.gone_after = 1
            await feed(api, running, items[6:8])
        await feed(api, running, items[8:])
        await until(lambda: running.watch.relists > relists, "a relist")
        await until(lambda: sorted(running.ids()) == sorted(pure(items)), "every event of the stream")
        no_duplicate_facts(running.events())
        assert len([e for e in running.events() if isinstance(e, RetryRequested)]) == 1
        assert [e.attempt for e in running.events() if isinstance(e, JobPlaced)] == [1, 2]


async def test_dropped_connections_and_slow_streams_lose_and_repeat_nothing(api, tmp_path):
    items = stream("jobset-oomkilled.ndjson")
    api.faults.slow_s = 0.02
    api.faults.drop_after, api.faults.drop_times = 1, 4
    async with Running(api, tmp_path) as running:
        await until(lambda: running.watch.ready, "the watch ready")
        await feed(api, running, items)
        await until(lambda: running.ids() == pure(items), "every event of the stream")
    assert len(api.watch_requests("pods")) > 2  # it reconnected after the cuts


async def test_deletions_while_the_watch_was_away_are_reconciled_by_the_relist(api, tmp_path):
    items = stream("jobset-oomkilled.ndjson")[:5]  # admitted, four pods running
    async with Running(api, tmp_path) as running:
        await until(lambda: running.watch.ready, "the watch ready")
        await feed(api, running, items)
        await until(lambda: any(isinstance(e, JobPlaced) for e in running.events()), "the placement")
        await api.stop()
        await until(lambda: not running.watch.ready, "not ready while the API server is away")
        assert running.watch.problems()
        gone = items[4]["object"]
        await api.apply("DELETED", gone)  # deleted while nobody watched, the history forgotten
        api.compact()
        await api.start()
        await until(lambda: running.watch.ready, "ready again")
        await until(
            lambda: any(isinstance(e, RankExited) and e.rank == 3 for e in running.events()),
            "the deleted pod's rank stopped",
        )
        no_duplicate_facts(running.events())


async def test_bookmarks_move_the_saved_version_and_a_restart_resumes_from_it(api, tmp_path):
    items = stream("kueue-podsreadytimeout.ndjson")
    state = tmp_path / "k8s-state.json"
    async with Running(api, tmp_path, state_file=state, namespaces=("team-a",)) as running:
        await until(lambda: running.watch.ready, "the watch ready")
        await feed(api, running, items[:5])
        last = api.version
        other = {"kind": "Pod", "metadata": {"name": "x", "namespace": "elsewhere", "uid": "other-1"}}
        await api.apply("ADDED", other)  # a change the team-a watches never see: only a bookmark moves them on
        await until(lambda: running.version_of("Workload") > last, "a bookmark past the last team-a change")
    saved = json.loads(state.read_text())
    bookmarked = saved["streams"]["Workload:team-a"]["resourceVersion"]
    assert int(bookmarked) > last
    first_ids = [json.loads(line)["id"] for line in Outbox(tmp_path / "k8s-outbox.ndjson").lines()]

    lists_before = len(api.list_requests("workloads"))
    async with Running(api, tmp_path, state_file=state, namespaces=("team-a",)) as resumed:
        await feed(api, resumed, items[5:])
        await until(lambda: resumed.ids() == pure(items), "the rest of the stream, after the first run's")
    assert len(api.list_requests("workloads")) == lists_before  # resumed: watched on, not listed again
    assert api.watch_requests("workloads")[-1]["resourceVersion"] >= bookmarked
    assert resumed.ids()[: len(first_ids)] == first_ids


async def test_the_api_server_away_at_start_is_not_ready_then_ready(tmp_path):
    api = FakeKubeApi()
    await api.start()
    await api.stop()  # the port is known, nothing listens
    async with Running(api, tmp_path) as running:
        await until(lambda: bool(running.watch.problems()) and not running.watch.ready, "not ready, with why")
        await api.start()
        try:
            await until(lambda: running.watch.ready, "ready once the API server answers")
            items = stream("node-states.ndjson")
            await feed(api, running, items)
            await until(lambda: running.ids() == pure(items), "the node states")
        finally:
            with contextlib.suppress(Exception):
                await api.stop()


def test_the_fake_servers_kinds_are_the_observers():
    assert set(PLURAL_OF) == {"Workload", "Pod", "Node", "Event"}
