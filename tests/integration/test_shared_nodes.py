"""Evidence belongs to the job that produced it, on nodes many jobs share (real servers, real processes).

150 short two-rank jobs on two nodes of 8 GPUs, so up to eight run beside each other on a node; a third of
them raise a ValueError in one rank (which one varies). The agent stamps each piece of evidence with the
job, attempt, rank and pid of the rank whose output it came from, so telemetry files every traceback under
its own job, whatever else runs on the node, and every failed job's finding names its own raising rank and
the algorithm lane (and so the algorithm owner, not the platform on-call).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

import pytest
from nats.aio.msg import Msg

from lanes_agent.launcher import LocalLauncher
from lanes_cli.bootstrap import prepare_services
from lanes_cli.demo import register_nodes, wait_for_nodes
from lanes_contract.client import LanesClient
from lanes_contract.codec import decode
from lanes_contract.errors import DecodeError
from lanes_contract.events import JobFinding, JobStateChanged, JobSubmitted, JobSubmittedData, RecoveryDecided
from lanes_contract.jobs import JobSpec, JobState, Owners, WorkloadClass
from lanes_runtime.service import connected, run_consumers
from lanes_runtime.settings import ServerUrls

pytestmark = [pytest.mark.real_servers, pytest.mark.slow]
JOBS = 150
NODES = {"node-1": 8, "node-2": 8}
_PROGRAM = """
import os, sys, time
job, rank = os.environ["LANES_JOB_ID"], int(os.environ["RANK"])
time.sleep(0.3)
if rank == int(sys.argv[1]):
    raise ValueError(f"bad batch in job={job} rank={rank}")
"""


class _Outcomes:
    """Each job's end as the timeline says: released after success, or a recovery decision after failure."""

    def __init__(self, jobs: set[str]) -> None:
        self.pending = set(jobs)
        self.findings: dict[str, JobFinding] = {}
        self.failed: set[str] = set()
        self.done = asyncio.Event()

    async def on_message(self, msg: Msg) -> None:
        with contextlib.suppress(DecodeError):
            event = decode(msg.subject, msg.headers, msg.data)
            job = event.job_key
            if isinstance(event, JobFinding):
                known = self.findings.get(job)
                if known is None or event.data.version > known.data.version:
                    self.findings[job] = event
            elif isinstance(event, JobStateChanged) and event.data.to_state is JobState.FAILED:
                self.failed.add(job)
            ended = isinstance(event, RecoveryDecided) or (
                isinstance(event, JobStateChanged)
                and event.data.to_state is JobState.RELEASED
                and job not in self.failed
            )
            if ended:
                self.pending.discard(job)
                if not self.pending:
                    self.done.set()


async def test_every_traceback_is_filed_under_its_own_job_on_shared_nodes(own_urls: ServerUrls) -> None:
    raising = {f"shared-{i:03d}": i % 2 for i in range(JOBS) if i % 3 == 0}
    jobs = [f"shared-{i:03d}" for i in range(JOBS)]
    async with connected(own_urls, name="test-shared-nodes") as conns:
        stop = asyncio.Event()
        consumers = await prepare_services(conns, ["scheduler", "lifecycle", "telemetry", "recovery"])
        tasks = [
            asyncio.create_task(run_consumers(consumers, stop)),
            asyncio.create_task(LocalLauncher(conns.nc, frozenset(NODES)).run(stop)),
        ]
        outcomes = _Outcomes(set(jobs))
        sub = await conns.nc.subscribe("lanes.job.>", cb=outcomes.on_message)
        try:
            client = LanesClient(conns.nc, "tests")
            await register_nodes(client, NODES)
            await wait_for_nodes(conns, len(NODES), 30)
            for job in jobs:
                spec = JobSpec(
                    name="shared",
                    workload_class=WorkloadClass.BATCH,
                    workers=2,
                    command=(sys.executable, "-c", _PROGRAM, str(raising.get(job, -1))),
                    owners=Owners(algorithm="ml-oncall"),
                )
                await client.publish(
                    JobSubmitted(source="tests", jobid=job, attempt=1, data=JobSubmittedData(spec=spec))
                )
            await asyncio.wait_for(outcomes.done.wait(), timeout=600)
            rows = await conns.pool.fetch(
                """SELECT job_id, rank, data->'lines' AS lines FROM telemetry_evidence
                   WHERE category = 'python_exception'"""
            )
        finally:
            await sub.unsubscribe()
            stop.set()
            await asyncio.gather(*tasks)
    assert outcomes.failed == set(raising)
    filed = 0
    for row in rows:
        text = str(row["lines"])
        named = next((job for job in raising if f"job={job} " in text), None)
        if named is None:
            continue  # a traceback line without the message (its frames): checked through its job below
        filed += 1
        assert (row["job_id"], row["rank"]) == (named, raising[named]), text
    assert filed >= len(raising)
    for job, rank in raising.items():
        finding = outcomes.findings[job].data
        assert finding.settled, finding.settle_reason
        assert finding.first_error is not None
        assert (finding.first_error.lane.value, finding.first_error.rank) == ("algorithm", rank), job
        assert f"job={job} " in " ".join(finding.first_error.evidence)
        assert finding.owner.startswith("algorithm team")
    for job in set(jobs) - set(raising):
        succeeded = outcomes.findings.get(job)
        assert succeeded is None or succeeded.data.first_error is None or succeeded.data.first_error.lane != "algorithm"
