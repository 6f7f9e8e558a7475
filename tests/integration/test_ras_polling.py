"""`lanes agent --ras`: when a job's collective stalls (its ranks' steps stop, or a watchdog says a collective
timed out), the node agent asks NCCL's RAS once for the attempt, and the answer joins the job's timeline as that
node's evidence.

There is no NCCL here, so nothing answers `ncclras`; the agent's RAS client is a command that prints a report
in `ncclras`'s own text format (what a 4-rank job's RAS says when rank 2 is one AllReduce behind). Everything
else is real: the services, the agent, the ranks' processes and their stall.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from support.cli import local_stack
from support.recovery import spec
from support.waiting import eventually

from lanes_agent.launcher import LocalLauncher
from lanes_agent.ras_poll import RasPolling
from lanes_cli.demo import DEMO_NODES
from lanes_cli.timeline import job_timeline
from lanes_contract.client import LanesClient
from lanes_contract.events import Event, JobEvidence, JobStateChanged, JobSubmitted, JobSubmittedData, RankStarted
from lanes_contract.jobs import JobState
from lanes_runtime.service import Connections
from lanes_runtime.settings import ServerUrls

pytestmark = pytest.mark.real_servers

BEHIND = 2
# Each rank steps, then waits in its collective (no more steps) until the job gives up on it.
_STALLS = """
import sys, time
for step in (1, 2, 3):
    print(f"lanes: step {step}", flush=True)
time.sleep(6)
sys.exit(1)
"""
# Each rank steps, then its watchdog says the collective timed out (PyTorch's line), and it exits.
_TIMES_OUT = """
import os, sys, time
rank = os.environ["RANK"]
print("lanes: step 1", flush=True)
time.sleep(1)
print(f"[rank{rank}]:[E1207 10:00:00.000000 {os.getpid()} ProcessGroupNCCL.cpp:616] [Rank {rank}] Watchdog caught "
      "collective operation timeout: WorkNCCL(SeqNum=4, OpType=ALLREDUCE, NumelIn=1024, NumelOut=1024, "
      "Timeout(ms)=600000) ran for 600021 milliseconds before timing out.", file=sys.stderr, flush=True)
time.sleep(2)
sys.exit(1)
"""
_REPORT = f"""Job summary
===========

  Nodes  Processes         GPUs  Processes     GPUs
(total)   per node  per process    (total)  (total)
      4          1            1          4        4

Communicators... (0.004s)
=============

Group     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors
    #  in group  per comm  per node  per comm  in group
    0         1         4         1         4         4   RUNNING  MISMATCH

Errors
======

Warnings
========

#0-0 (5e2a90c4b7d1f036) MISMATCH
  Communicator ranks have different AllReduce operation counts
  3 ranks have launched up to operation 4
  Rank {BEHIND} has launched up to operation 3 -- GPU 0 managed by process 31337 on node node-3
"""


async def _timeline(conns: Connections, job_id: str) -> list[Event]:
    return [e.event for e in await job_timeline(conns.nc.jetstream(), job_id) if e.event is not None]


def _ras_lines(events: list[Event]) -> list[JobEvidence]:
    return [e for e in events if isinstance(e, JobEvidence) and e.data.evidence.summary.startswith("NCCL RAS: ")]


@pytest.mark.parametrize(
    ("program", "stall_s"),
    [(_STALLS, 1.5), (_TIMES_OUT, 600.0)],
    ids=["steps-stop", "watchdog-timeout"],
)
async def test_a_stalled_job_gets_one_ras_report_naming_the_rank_behind(
    own_urls: ServerUrls, tmp_path: Path, program: str, stall_s: float
) -> None:
    report = tmp_path / "ras.txt"
    report.write_text(_REPORT)
    job_id = "ras-stall"
    async with local_stack(own_urls, ["scheduler", "lifecycle", "telemetry"], agent=False) as conns:
        stop = asyncio.Event()
        polling = RasPolling(command=("cat", str(report)), stall_s=stall_s)
        agent = asyncio.create_task(LocalLauncher(conns.nc, frozenset(DEMO_NODES), ras=polling).run(stop))
        try:
            job = spec("ras", workers=4, gpus_per_worker=4, command=(sys.executable, "-c", program))  # a node each
            await LanesClient(conns.nc, "tests").publish(
                JobSubmitted(source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=job))
            )

            async def ended() -> bool:
                return any(
                    isinstance(e, JobStateChanged) and e.data.to_state is JobState.RELEASED
                    for e in await _timeline(conns, job_id)
                )

            await eventually(ended, timeout_s=60, what="the stalled job's end")
            await eventually(lambda: _ras_seen(conns, job_id), what="RAS's report on the timeline")
            events = await _timeline(conns, job_id)
        finally:
            stop.set()
            await agent

    ras = _ras_lines(events)
    # Four ranks stalled on four nodes; RAS was asked once for the attempt: one line per member of the comm.
    assert len(ras) == 4, [e.data.evidence.summary for e in ras]
    assert sorted(e.rank for e in ras if e.rank is not None) == [0, 1, 2, 3]
    (behind,) = [e for e in ras if "(behind;" in e.data.evidence.summary]
    assert behind.rank == BEHIND
    assert behind.data.evidence.last_enqueued == 3
    assert all(e.attempt == 1 for e in ras)
    # What one node's RAS client said about ranks elsewhere is that node's word, not the other nodes'.
    ran_on = {e.rank: e.node for e in events if isinstance(e, RankStarted)}
    assert len(set(ran_on.values())) == 4, ran_on
    (asked,) = {e.node for e in ras}
    assert asked in ran_on.values()


async def _ras_seen(conns: Connections, job_id: str) -> bool:
    return len(_ras_lines(await _timeline(conns, job_id))) >= 4
