"""Lifecycle scenarios for `lanes demo`: a job cancelled while starting, and a job whose one rank fails.

Each scenario runs against a stack that is already up (services consuming, a LocalLauncher running,
nodes registered), submits its own job, drives it and returns the job id once the job's GPUs are released
(the failing one then waits for its owner), so the caller can read its timeline. Both fit on one node
with two free GPUs; on a busier cluster they wait in the queue first, which only makes them slower.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Iterable

from nats.aio.msg import Msg

from lanes_contract.client import LanesClient
from lanes_contract.codec import decode
from lanes_contract.errors import DecodeError
from lanes_contract.events import (
    CancelRequested,
    CommandData,
    JobStateChanged,
    JobSubmitted,
    JobSubmittedData,
)
from lanes_contract.ids import new_event_id
from lanes_contract.jobs import JobSpec, JobState, Owners, WorkloadClass
from lanes_runtime.service import Connections

SOURCE = "lanes/demo"
CANCELLED_WHILE_STARTING = (
    JobState.QUEUED,
    JobState.ADMITTED,
    JobState.STARTING,
    JobState.CANCELLING,
    JobState.CANCELLED,
    JobState.RELEASED,
)
ONE_RANK_FAILS = (
    JobState.QUEUED,
    JobState.ADMITTED,
    JobState.STARTING,
    JobState.RUNNING,
    JobState.PARTIALLY_FAILED,
    JobState.FAILED,
    JobState.RELEASED,
    JobState.AWAITING_MANUAL,
)
"""The state sequences the two scenarios produce (what a test of the wired demo can assert). Once the
failed job's GPUs are released, recovery puts it on the manual path: an algorithm-lane error is not
retried, so it waits for its owner."""

# Never prints the launcher's ready marker: the ranks sit in communicator init until they are stopped.
_STUCK_IN_INIT = "import time\ntime.sleep(120)\n"
# Both ranks get ready; rank 1 then fails in user code (after 2 s, so that both ready reports are in even
# on a slow machine): an uncaught exception, whose traceback the launcher reads as algorithm-lane evidence.
# Rank 0 keeps training until it is torn down.
_RANK_1_FAILS = (
    "import os, time\n"
    "print('lanes: communicator ready', flush=True)\n"
    "def training_step(step):\n"
    "    raise FloatingPointError(f'loss is NaN at step {step}')\n"
    "if os.environ['RANK'] == '1':\n"
    "    time.sleep(2)\n"
    "    training_step(1200)\n"
    "time.sleep(120)\n"
)


class _States:
    """The job's state changes as they are published, subscribed to before the job is submitted."""

    def __init__(self) -> None:
        self.seen: list[JobState] = []
        self._changed = asyncio.Condition()

    async def on_message(self, msg: Msg) -> None:
        with contextlib.suppress(DecodeError):
            event = decode(msg.subject, msg.headers, msg.data)
            if isinstance(event, JobStateChanged):
                async with self._changed:
                    self.seen.append(event.data.to_state)
                    self._changed.notify_all()

    async def reached(self, states: Iterable[JobState], timeout_s: float) -> JobState:
        wanted = frozenset(states)
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(lambda: bool(wanted & set(self.seen)))
        return next(s for s in self.seen if s in wanted)


async def _submit(conns: Connections, job_id: str, spec: JobSpec) -> _States:
    states = _States()
    await conns.nc.subscribe(f"lanes.job.{job_id}.state_changed", cb=states.on_message)
    client = LanesClient(conns.nc, SOURCE)
    await client.publish(JobSubmitted(source=SOURCE, jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec)))
    return states


async def cancelled_while_starting(conns: Connections, *, timeout_s: float = 60.0) -> str:
    """A 2-rank job whose ranks never finish communicator init; a user cancels it while it is `starting`.

    The lifecycle moves it to `cancelling`, the launcher terminates the ranks, their exits (signal 15) make
    it `cancelled` with cause user_cancel, and the scheduler's release makes it `released`.
    """
    job_id = f"demo-cancel-{new_event_id()[-12:]}"
    spec = JobSpec(
        name="demo-cancel",
        workload_class=WorkloadClass.EVALUATION,
        workers=2,
        gpus_per_worker=1,
        command=(sys.executable, "-c", _STUCK_IN_INIT),
        owners=Owners(algorithm="eval-team"),
    )
    states = await _submit(conns, job_id, spec)
    await states.reached({JobState.STARTING}, timeout_s)
    cancel = CancelRequested(
        source=SOURCE, jobid=job_id, data=CommandData(reason="wrong eval set", requested_by="demo-user")
    )
    await LanesClient(conns.nc, SOURCE).publish(cancel)
    await states.reached({JobState.RELEASED}, timeout_s)
    return job_id


async def one_rank_fails(conns: Connections, *, timeout_s: float = 60.0) -> str:
    """A 2-rank job whose rank 1 dies of an uncaught exception (exit code 1) while rank 0 still runs.

    The lifecycle marks it `partially_failed` (the job is not decided while rank 0 runs), the launcher
    tears down the rest of the gang as torchrun's agent would, and once every rank has ended it is `failed`
    with cause user_code_error naming rank 1. Recovery does not retry an algorithm-lane error: the job
    goes to `awaiting_manual` for its algorithm owner once its GPUs are released.
    """
    job_id = f"demo-fail-{new_event_id()[-12:]}"
    spec = JobSpec(
        name="demo-fail",
        workers=2,
        gpus_per_worker=1,
        command=(sys.executable, "-c", _RANK_1_FAILS),
        owners=Owners(algorithm="ml-oncall"),
    )
    states = await _submit(conns, job_id, spec)
    await states.reached({JobState.AWAITING_MANUAL}, timeout_s)
    return job_id
