"""A 3-node NATS cluster from the embedded binary (three local processes, R3 streams) loses the leader of
the job stream under load: no acknowledged event is lost, and the producer is publishing again shortly.

The time from the kill to the first acknowledged publish after it is measured and printed (run with -s to
see it), beside the time the survivors take to elect a new stream leader; it is not asserted, since it depends
on the machine's load (a slow machine must only make a test slower). The two track each other: a client's
reconnect is immediate, and the stream accepts writes again as soon as raft's election (nats-server waits a random 4-9 s
without heartbeats before a follower campaigns) is over.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import time

import nats
import pytest
from nats.errors import Error as NatsError
from support.waiting import eventually

from lanes_contract.client import LanesClient, connect_nats
from lanes_contract.errors import LanesError
from lanes_contract.events import Heartbeat, HeartbeatData
from lanes_contract.streams import JOBS
from lanes_runtime.reader import Selection, iter_stream
from lanes_sandbox.embedded import EmbeddedNats, EmbeddedNatsCluster

pytestmark = [pytest.mark.real_servers, pytest.mark.slow]


async def test_losing_the_stream_leader_under_load_loses_no_acknowledged_event(unique: str) -> None:
    job = f"cluster-{unique}"
    with EmbeddedNatsCluster() as cluster:
        producer = await LanesClient.connect(cluster.url_for("producer"), source="agent/node-1")
        acked: dict[str, float] = {}  # event id -> when its publish was acknowledged
        stop = asyncio.Event()

        async def load() -> None:
            step = 0
            while not stop.is_set():
                event = Heartbeat(
                    source="agent/node-1", jobid=job, attempt=1, node="node-1", rank=0, data=HeartbeatData(step=step)
                )
                while not stop.is_set():
                    try:
                        await producer.publish(event)
                    except (TimeoutError, NatsError, LanesError):
                        await asyncio.sleep(0.02)  # the same event (same id) again: JetStream de-duplicates
                        continue
                    acked[event.id] = time.monotonic()
                    break
                step += 1

        loading = asyncio.create_task(load())
        try:
            await eventually(lambda: _at_least(acked, 200), what="200 acknowledged events before the fault")
            info = await producer.js.stream_info(JOBS.name)
            assert info.cluster is not None
            assert info.config.num_replicas == 3
            leader = next(s for s in cluster.servers if s.server_name == info.cluster.leader)
            assert leader.pid is not None
            before = len(acked)
            survivors = ",".join(s.url for s in cluster.servers if s is not leader)
            killed_at = time.monotonic()
            reconnected_s, elected_s = await _kill_and_time_the_recovery(cluster, leader)
            await eventually(
                lambda: _at_least(acked, before + 200), timeout_s=60, what="200 more events after the kill"
            )
        finally:
            stop.set()
            await loading
            reconnects = producer._nc.stats["reconnects"]
            await producer.close()
        # The outage as the producer saw it: the longest wait between two acknowledgements around the kill.
        times = sorted(acked.values())
        outage_s = max(b - a for a, b in itertools.pairwise(times) if b > killed_at)
        print(  # noqa: T201
            f"stream leader killed: a client of the killed server reconnected after {reconnected_s:.2f} s;"
            f" new leader elected after {elected_s:.2f} s;"
            f" longest gap between acknowledged publishes {outage_s:.2f} s; producer reconnects {reconnects}"
        )

        reader = await connect_nats(survivors, name="cluster-check")
        try:
            stored = [
                msg.headers.get("ce-id")
                async for msg in iter_stream(reader.jetstream(), Selection(JOBS.name, f"lanes.job.{job}.heartbeat"))
                if msg.headers
            ]
        finally:
            await reader.close()
        assert set(acked) <= set(stored), f"{len(set(acked) - set(stored))} acknowledged events lost"
        assert len(stored) == len(set(stored)), "an event was stored twice"


async def _kill_and_time_the_recovery(cluster: EmbeddedNatsCluster, leader: EmbeddedNats) -> tuple[float, float]:
    """SIGKILL the stream leader. Seconds until a client connected to it is connected again (to a server it
    learnt from the cluster), and until the survivors report another leader for the job stream (raft)."""
    assert leader.pid is not None
    others = [server for server in cluster.servers if server is not leader]
    # A client whose first server is the leader, with the rest of the cluster to fall back on, as a service
    # given NATS_URL with every server in it would be (and nats-py's own reconnect settings, as connect_nats).
    pinned = await nats.connect(
        servers=[s.url_for("producer") for s in (leader, *others)], dont_randomize=True, reconnect_time_wait=0.5
    )
    assert pinned.connected_url is not None
    assert pinned.connected_url.port == leader.port
    watcher = await connect_nats(",".join(s.url for s in others), name="leader-watch")
    js = watcher.jetstream(timeout=0.25)  # short: a request sent while there is no leader is never answered
    killed_at = time.monotonic()
    os.kill(leader.pid, signal.SIGKILL)
    reconnected_s = elected_s = None
    try:
        while reconnected_s is None or elected_s is None:
            if reconnected_s is None and pinned.stats["reconnects"] and pinned.is_connected:
                reconnected_s = time.monotonic() - killed_at
            if elected_s is None:
                with contextlib.suppress(TimeoutError, NatsError):
                    info = await js.stream_info(JOBS.name)
                    if info.cluster is not None and info.cluster.leader not in (None, leader.server_name):
                        elected_s = time.monotonic() - killed_at
            await asyncio.sleep(0.02)
    finally:
        await watcher.close()
        await pinned.close()
    return reconnected_s, elected_s


async def _at_least(acked: dict[str, float], count: int) -> bool:
    return len(acked) >= count
