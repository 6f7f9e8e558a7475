"""An outage is never poison: PostgreSQL frozen for longer than the whole redelivery schedule, jobs in flight.

The whole stack (scheduler, lifecycle, telemetry, recovery, audit and a node agent) runs against a NATS and
a PostgreSQL of this test's own. Every PostgreSQL process is stopped (SIGSTOP: each query and each new
connection hangs until it times out) for longer than the consumers' whole redelivery schedule, while ten
jobs are running, then resumed. Afterwards every job has finished, LANES_DEAD holds nothing, the lifecycle
projection equals a clean fold of the log and the audit chain verifies.
"""

from __future__ import annotations

import asyncio
import sys

import pytest
from support.cli import local_stack, run_lanes_async
from support.freezing import frozen
from support.waiting import eventually

from lanes_contract.client import LanesClient
from lanes_contract.events import JobSubmitted, JobSubmittedData
from lanes_contract.jobs import JobSpec
from lanes_contract.streams import DEAD
from lanes_lifecycle.entrypoints.service import JOB_EVENTS
from lanes_runtime.settings import ServerUrls
from lanes_sandbox.embedded import EmbeddedPostgres

pytestmark = pytest.mark.real_servers

JOBS = 10
_RANK = "import time; print('lanes: communicator ready', flush=True); time.sleep(4)"


@pytest.mark.slow
async def test_postgres_frozen_longer_than_the_redelivery_schedule_loses_nothing_and_dead_letters_nothing(
    own_urls: ServerUrls, unique: str
) -> None:
    schedule_s = sum(JOB_EVENTS.redelivery_delays_s)
    with EmbeddedPostgres() as postgres:
        urls = ServerUrls(own_urls.nats_url, postgres.url, own_urls.redis_url)
        async with local_stack(urls, ["scheduler", "lifecycle", "telemetry", "recovery", "audit"]) as conns:
            client = LanesClient(conns.nc, "tests")
            spec = JobSpec(name="steady", workers=2, command=(sys.executable, "-c", _RANK))
            job_ids = [f"outage-{i}-{unique}" for i in range(JOBS)]
            for job_id in job_ids:
                await client.publish(
                    JobSubmitted(source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec))
                )

            async def states() -> dict[str, str]:
                rows = await conns.pool.fetch(
                    "SELECT job_id, state FROM lifecycle_jobs WHERE job_id = ANY($1::text[])", job_ids
                )
                return {row["job_id"]: row["state"] for row in rows}

            async def some_running() -> bool:
                return "running" in (await states()).values()

            await eventually(some_running, timeout_s=120, what="jobs in flight")
            with frozen(postgres):
                await asyncio.sleep(schedule_s + 10)  # longer than every consumer's whole redelivery schedule

            async def all_terminal() -> bool:
                found = await states()
                return len(found) == JOBS and set(found.values()) <= {"succeeded", "released"}

            await eventually(all_terminal, timeout_s=300, what="every job finished after the outage")
            js = conns.nc.jetstream()
            letters = [
                await js.get_msg(DEAD.name, seq)
                for seq in range(1, (await js.stream_info(DEAD.name)).state.last_seq + 1)
            ]
            assert letters == [], [dict(m.headers or {}) for m in letters]  # an outage dead-letters nothing

            # The lifecycle stages events in its inbox and folds them in order; a job can look finished
            # ("succeeded") while its release is still staged. Nothing may stay there: it drains, or this fails.
            async def inbox_drained() -> bool:
                return int(await conns.pool.fetchval("SELECT count(*) FROM lanes_inbox")) == 0

            await eventually(inbox_drained, timeout_s=60, what="the lifecycle's inbox drained")
        rebuilt = await run_lanes_async(urls, "projections", "rebuild", "--verify")
        assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
        audited = await run_lanes_async(urls, "audit", "verify")
        assert audited.returncode == 0, audited.stdout + audited.stderr
