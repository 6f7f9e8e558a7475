"""The local launcher as a node agent: what a rank prints becomes events on the job's timeline.

Real scheduler and lifecycle consumers, a real launcher and real rank processes on a test's own NATS.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.msg import Msg
from support.cli import local_stack
from support.waiting import eventually

from lanes_agent.cgroups import MemoryCgroups
from lanes_cli.demo import DEMO_NODES
from lanes_cli.timeline import job_timeline
from lanes_contract.client import LanesClient
from lanes_contract.events import (
    CheckpointSaved,
    CommunicatorReady,
    Event,
    EvidenceCategory,
    Heartbeat,
    JobEvidence,
    JobFinding,
    JobStateChanged,
    JobSubmitted,
    JobSubmittedData,
    Lane,
    RankExited,
    RankStarted,
    ReplicaListening,
    RetryData,
    RetryRequested,
)
from lanes_contract.jobs import FailureCause, JobSpec, JobState, ServingSpec, WorkloadClass
from lanes_contract.streams import DEAD, JOBS
from lanes_runtime.delivery import DEAD_REASON, DEAD_SUBJECT
from lanes_runtime.service import Connections
from lanes_runtime.settings import ServerUrls

pytestmark = pytest.mark.real_servers
GRACE_S = 1.0

MODEL_VERSION = "sha256:" + "12" * 32
# Attempt 1 trains to step 12, checkpoints step 10 and fails; attempt 2 reports the step it resumed from.
_TRAINER = f"""
import os, sys
if os.environ["LANES_ATTEMPT"] == "1":
    print("lanes: communicator ready", flush=True)
    print("lanes: step 10", flush=True)
    print("lanes: checkpoint saved step=10 path=/ckpt/10 digest=sha256:{"ab" * 32} "
          f"model_version={{os.environ['LANES_MODEL_VERSION']}}", flush=True)
    print("lanes: step 12", flush=True)
    sys.exit(1)
print("lanes: communicator ready", flush=True)
print(f"lanes: step {{os.environ['LANES_RESUME_STEP']}}", flush=True)
"""
_SERVER = "print('INFO:     Uvicorn running on http://0.0.0.0:8123 (Press CTRL+C to quit)', flush=True)"


@pytest.fixture
async def stack(own_urls: ServerUrls) -> AsyncIterator[Connections]:
    """Scheduler, lifecycle and a launcher for the demo's nodes."""
    async with local_stack(own_urls, ["scheduler", "lifecycle"], stop_grace_s=GRACE_S) as conns:
        yield conns


async def _events(conns: Connections, job_id: str) -> list[Event]:
    return [entry.event for entry in await job_timeline(conns.nc.jetstream(), job_id) if entry.event is not None]


async def _released(conns: Connections, job_id: str, attempt: int) -> bool:
    return any(
        isinstance(e, JobStateChanged) and e.data.to_state is JobState.RELEASED and e.attempt == attempt
        for e in await _events(conns, job_id)
    )


async def test_steps_and_checkpoints_become_events_and_a_retry_resumes_at_the_checkpoint_step(
    stack: Connections, unique: str
) -> None:
    job_id = f"trainer-{unique}"
    spec = JobSpec(name="trainer", workers=1, command=(sys.executable, "-c", _TRAINER), model_version=MODEL_VERSION)
    client = LanesClient(stack.nc, "tests")
    await client.publish(JobSubmitted(source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec)))
    await eventually(lambda: _released(stack, job_id, 1), what="attempt 1 released")

    events = await _events(stack, job_id)
    assert [e.data.step for e in events if isinstance(e, Heartbeat)] == [10, 12]
    (saved,) = [e for e in events if isinstance(e, CheckpointSaved)]
    assert (saved.data.step, saved.data.path, saved.data.model_version) == (10, "/ckpt/10", MODEL_VERSION)
    assert saved.rank == 0
    assert saved.node in DEMO_NODES

    retry = RetryRequested(source="tests", jobid=job_id, attempt=1, data=RetryData(reason="resume"))
    await client.publish(retry)
    await eventually(lambda: _released(stack, job_id, 2), what="attempt 2 released")
    resumed = [e.data.step for e in await _events(stack, job_id) if isinstance(e, Heartbeat) and e.attempt == 2]
    assert resumed == [10]  # the lifecycle's resume step reached the rank as LANES_RESUME_STEP


async def test_a_serving_replica_announces_its_endpoint_when_it_listens(stack: Connections, unique: str) -> None:
    job_id = f"replica-{unique}"
    spec = JobSpec(
        name="replica",
        workload_class=WorkloadClass.INFERENCE,
        workers=1,
        command=(sys.executable, "-c", _SERVER),
        serving=ServingSpec(model="tiny-chat", version="v1"),
    )
    await LanesClient(stack.nc, "tests").publish(
        JobSubmitted(source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec))
    )
    await eventually(lambda: _released(stack, job_id, 1), what="replica released")
    events = await _events(stack, job_id)
    (listening,) = [e for e in events if isinstance(e, ReplicaListening)]
    assert listening.data.endpoint == "http://127.0.0.1:8123"
    assert [e.data.backend for e in events if isinstance(e, CommunicatorReady)] == ["http"]


async def test_a_placement_whose_rank_cannot_be_started_is_dead_lettered_with_the_reason(
    stack: Connections, unique: str
) -> None:
    job_id = f"unstartable-{unique}"
    spec = JobSpec(name="unstartable", workers=1, command=(f"/nonexistent/{unique}/train",))
    client = LanesClient(stack.nc, "tests")
    await client.publish(JobSubmitted(source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec)))
    dead_subject = f"lanes.dead.{JOBS.name}.launcher-local"

    async def dead_letter_for_job() -> bool:
        return any(
            job_id in (letter.headers or {}).get(DEAD_SUBJECT, "") for letter in await _letters(stack, dead_subject)
        )

    await eventually(dead_letter_for_job, what="the placement's dead letter")
    (letter,) = [m for m in await _letters(stack, dead_subject) if job_id in (m.headers or {}).get(DEAD_SUBJECT, "")]
    headers = letter.headers or {}
    assert headers[DEAD_SUBJECT] == f"lanes.job.{job_id}.placed"
    assert "cannot be started" in headers[DEAD_REASON]
    assert f"/nonexistent/{unique}/train" in headers[DEAD_REASON]
    assert headers["Lanes-Dead-Deliveries"] == "1"  # the event itself is bad: at once, not after retries

    # The rank's exit says it never ran, so the job fails (platform lane) instead of sitting admitted.
    await eventually(lambda: _released(stack, job_id, 1), what="the unstartable job released")
    events = await _events(stack, job_id)
    (exited,) = [e for e in events if isinstance(e, RankExited)]
    assert exited.data.start_error is not None
    assert f"/nonexistent/{unique}/train" in exited.data.start_error
    assert exited.lane is Lane.PLATFORM
    failed = next(e for e in events if isinstance(e, JobStateChanged) and e.data.to_state is JobState.FAILED)
    assert failed.data.cause is FailureCause.PLATFORM_ACTION
    assert "could not be started" in failed.data.reason


_STUBBORN = """
import os, signal, sys, time
if os.environ["RANK"] == "0":
    print("lanes: communicator ready", flush=True)
    time.sleep(0.5)
    sys.exit(3)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("lanes: communicator ready", flush=True)
while True:
    time.sleep(1)
"""


async def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace_and_its_exit_says_so(
    stack: Connections, unique: str
) -> None:
    job_id = f"stubborn-{unique}"
    spec = JobSpec(name="stubborn", workers=2, command=(sys.executable, "-c", _STUBBORN))
    await LanesClient(stack.nc, "tests").publish(
        JobSubmitted(source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec))
    )
    await eventually(lambda: _released(stack, job_id, 1), what="the job released")
    events = await _events(stack, job_id)
    exits = {e.rank: e.data for e in events if isinstance(e, RankExited)}
    assert exits[0].exit_code == 3
    assert exits[1].signal == signal.SIGKILL
    assert exits[1].killed_after_grace_s == GRACE_S
    failed = next(e for e in events if isinstance(e, JobStateChanged) and e.data.to_state is JobState.FAILED)
    assert failed.data.cause is FailureCause.USER_CODE_ERROR  # rank 0's exit, not the enforced stop
    assert "exited with code 3" in failed.data.reason


_GLOO = """
import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # env://: MASTER_ADDR and MASTER_PORT come from the launcher
total = torch.ones(4) * (dist.get_rank() + 1)
dist.all_reduce(total)
print(f"reduced {total[0].item():g}", flush=True)
dist.destroy_process_group()
"""


async def test_an_unmodified_torch_distributed_job_finds_its_peers_through_the_launcher(
    stack: Connections, unique: str
) -> None:
    if importlib.util.find_spec("torch") is None:
        if os.environ.get("LANES_REQUIRE_TORCH"):
            pytest.fail("LANES_REQUIRE_TORCH is set but torch is not installed")
        pytest.skip("torch (the `drill` group) is not installed")
    job_id = f"gloo-{unique}"
    spec = JobSpec(name="gloo", workers=2, command=(sys.executable, "-c", _GLOO))
    await LanesClient(stack.nc, "tests").publish(
        JobSubmitted(source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec))
    )
    await eventually(lambda: _released(stack, job_id, 1), what="the gloo job released", timeout_s=90)
    events = await _events(stack, job_id)
    assert sorted((e.rank, e.data.exit_code) for e in events if isinstance(e, RankExited)) == [(0, 0), (1, 0)]
    assert any(isinstance(e, JobStateChanged) and e.data.to_state is JobState.SUCCEEDED for e in events)


async def _letters(conns: Connections, subject: str) -> list[Msg]:
    js = conns.nc.jetstream()
    info = await js.stream_info(DEAD.name, subjects_filter=subject)
    if not (info.state.subjects or {}).get(subject):
        return []
    sub = await js.subscribe(subject, stream=DEAD.name, ordered_consumer=True)
    letters = []
    try:
        while True:
            msg = await sub.next_msg(timeout=5)
            letters.append(msg)
            if msg.metadata.num_pending == 0:
                return letters
    finally:
        await sub.unsubscribe()


KMSG = Path("/dev/kmsg")
# A rank on a node whose kernel OOM-kills it: the kernel's line goes to the real kernel log (written here,
# as the kernel would, since this machine has no memory pressure to spare), then the process dies of SIGKILL.
_OOM_KILLED = """
import os, signal, time
print("lanes: communicator ready", flush=True)
time.sleep(0.5)
pid = os.getpid()
with open("/dev/kmsg", "w") as kmsg:
    kmsg.write(f"<3>Memory cgroup out of memory: Killed process {pid} (python) total-vm:2048000kB, "
               f"anon-rss:1024000kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:2100kB oom_score_adj:0\\n")
os.kill(pid, signal.SIGKILL)
"""


@pytest.mark.skipif(not os.access(KMSG, os.R_OK | os.W_OK), reason="needs a readable, writable /dev/kmsg (root)")
async def test_a_real_kernel_oom_line_naming_a_ranks_pid_becomes_that_ranks_settled_first_error(
    own_urls: ServerUrls, unique: str
) -> None:
    job_id = f"kmsg-oom-{unique}"
    async with local_stack(own_urls, ["scheduler", "lifecycle", "telemetry"], kernel_log=KMSG) as conns:
        spec = JobSpec(name="oom", workers=1, command=(sys.executable, "-c", _OOM_KILLED))
        await LanesClient(conns.nc, "tests").publish(
            JobSubmitted(source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec))
        )

        async def settled() -> bool:
            return any(isinstance(e, JobFinding) and e.data.settled for e in await _events(conns, job_id))

        await eventually(settled, what="a settled finding", timeout_s=60)
        events = await _events(conns, job_id)
    (started,) = [e for e in events if isinstance(e, RankStarted)]
    copies = [e for e in events if isinstance(e, JobEvidence) and e.data.evidence.category is EvidenceCategory.OOM_KILL]
    assert [(c.rank, c.data.evidence.pid, c.data.evidence.origin) for c in copies] == [(0, started.data.pid, "kmsg")]
    finding = [e for e in events if isinstance(e, JobFinding) and e.data.settled][-1]
    first = finding.data.first_error
    assert first is not None
    assert (first.category, first.lane, first.rank) == ("oom_kill", Lane.HOST, 0)
    assert finding.data.settle_reason.startswith("every rank")  # the kernel line arrived: no window ran out


# An unmodified memory hog: it grows until something stops it.
_HOG = """
import time
print("lanes: communicator ready", flush=True)
held = []
while True:
    held.append(bytearray(16 << 20))  # 16 MiB, written (a bytearray is zero-filled), so really resident
    time.sleep(0.01)
"""


@pytest.mark.skipif(
    not (os.access(KMSG, os.R_OK) and MemoryCgroups().unavailable() is None),
    reason="needs root: /dev/kmsg and a cgroup v1 memory controller",
)
async def test_a_rank_over_its_host_memory_is_killed_by_the_kernels_oom_killer_and_that_is_the_first_error(
    own_urls: ServerUrls, unique: str
) -> None:
    job_id = f"real-oom-{unique}"
    async with local_stack(own_urls, ["scheduler", "lifecycle", "telemetry"], kernel_log=KMSG) as conns:
        spec = JobSpec(name="hog", workers=1, host_memory_gib=0.125, command=(sys.executable, "-c", _HOG))
        await LanesClient(conns.nc, "tests").publish(
            JobSubmitted(source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec))
        )

        async def settled() -> bool:
            return any(isinstance(e, JobFinding) and e.data.settled for e in await _events(conns, job_id))

        await eventually(settled, what="a settled finding", timeout_s=90)
        events = await _events(conns, job_id)
    (started,) = [e for e in events if isinstance(e, RankStarted)]
    (exited,) = [e for e in events if isinstance(e, RankExited)]
    assert exited.data.signal == signal.SIGKILL  # the kernel's OOM killer, not anything Lanes did
    kills = [e for e in events if isinstance(e, JobEvidence) and e.data.evidence.category is EvidenceCategory.OOM_KILL]
    # The kernel says it twice (`oom-kill:constraint=CONSTRAINT_MEMCG,...,pid=N` and `Memory cgroup out of memory:
    # Killed process N`); either settles the finding, and every one names the rank's pid: all are the rank's.
    assert kills
    assert {(e.rank, e.data.evidence.pid) for e in kills} == {(0, started.data.pid)}
    assert all(e.data.evidence.lines[0].startswith(("oom-kill:", "Memory cgroup out of memory")) for e in kills)
    finding = [e for e in events if isinstance(e, JobFinding) and e.data.settled][-1]
    first = finding.data.first_error
    assert first is not None
    assert (first.category, first.lane, first.rank) == ("oom_kill", Lane.HOST, 0)
    assert not (MemoryCgroups().root / f"{job_id}-a1-r0").exists()  # the rank's cgroup is gone with it
