"""An agent that died between publishing a rank's event and recording it stored publishes it only if the log
lacks it, however long ago it died: the ledger and the log decide, not JetStream's duplicate window.

The ledger is what an earlier run left (records written here in its format); the launcher runs in this
process against a NATS server of the test's own whose job stream has a one-second duplicate window.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from nats.js.errors import NotFoundError
from support.stored_events import job_events_stored
from support.waiting import eventually

from lanes_agent.launcher import LocalLauncher
from lanes_agent.ledger import RankLedger, RankRecord
from lanes_contract.client import LanesClient, connect_nats
from lanes_contract.events import (
    JobPlaced,
    JobPlacedData,
    JobSubmitted,
    JobSubmittedData,
    RankAssignment,
    RankExitedData,
    RankStarted,
    RankStartedData,
    derive,
)
from lanes_contract.jobs import JobSpec
from lanes_contract.streams import JOBS
from lanes_sandbox.embedded import EmbeddedNats

pytestmark = pytest.mark.real_servers
_WINDOW_S = 1.0
_NODES = ("node-1", "node-2")


def _started(placed: JobPlaced, rank: int, pid: int) -> RankStarted:
    """The rank's start event as the agent derives it from the placement."""
    keys = {"source": f"agent/{_NODES[rank]}", "node": _NODES[rank], "rank": rank}
    return derive(RankStarted, placed, key=str(rank), data=RankStartedData(pid=pid), **keys)


async def test_a_start_sent_but_never_recorded_stored_is_published_only_where_the_log_lacks_it(
    secured_nats: EmbeddedNats, tmp_path: Path, unique: str
) -> None:
    nc = await connect_nats(secured_nats.url, name="tests")
    js = nc.jetstream()
    config = (await js.stream_info(JOBS.name)).config
    config.duplicate_window = _WINDOW_S
    await js.update_stream(config)
    job_id = f"sent-not-stored-{unique}"
    client = LanesClient(nc, "tests")
    spec = JobSpec(name="done", workers=2)
    await client.publish(JobSubmitted(source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec)))
    assignments = tuple(RankAssignment(rank=rank, node=node, gpus=(0,)) for rank, node in enumerate(_NODES))
    placed = JobPlaced(source="tests", jobid=job_id, attempt=1, data=JobPlacedData(assignments=assignments))
    await client.publish(placed)
    # The earlier run: both ranks ran and ended; it began publishing both starts and died before either was
    # acknowledged. Rank 0's reached the log, rank 1's did not. Then it stayed away longer than the window.
    pids = (4100, 4101)
    ledger = RankLedger(tmp_path / "ranks")
    ended = RankExitedData(exit_code=0, evidence=0).model_dump(mode="json")
    for rank, node in enumerate(_NODES):
        earlier = RankRecord(placed.id, rank, job_id, 1, node, "earlier-run", pid=pids[rank], pid_start=1, exit=ended)
        ledger.put(earlier.sending(_started(placed, rank, pids[rank]).id))
    await client.publish(_started(placed, 0, pids[0]))
    await asyncio.sleep(2 * _WINDOW_S)

    stop = asyncio.Event()
    launcher = LocalLauncher(nc, frozenset(_NODES), state_dir=tmp_path / "ranks", heartbeat_s=60)
    running = asyncio.create_task(launcher.run(stop))
    try:

        async def placement_done() -> bool:
            try:
                info = await js.consumer_info(JOBS.name, launcher.name)
            except NotFoundError:
                return False  # the launcher has not made its consumer yet
            exits = sum(
                count for (kind, _), count in (await job_events_stored(js, job_id)).items() if kind == "rank_exited"
            )
            return info.num_pending == 0 and info.num_ack_pending == 0 and exits == len(_NODES)

        await eventually(placement_done, timeout_s=60, what="the placement handled and acknowledged")
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await running
    stored = await job_events_stored(js, job_id)
    await nc.close()
    starts = {rank: ("rank_started", _started(placed, rank, pids[rank]).id) for rank in range(len(_NODES))}
    assert [stored[starts[rank]] for rank in range(len(_NODES))] == [1, 1]  # found on the log; published once
    assert [key for key, count in stored.items() if count > 1] == []
    for rank in range(len(_NODES)):
        record = ledger.get(placed.id, rank)
        assert record is not None
        assert starts[rank][1] in record.stored  # a later run publishes neither again
