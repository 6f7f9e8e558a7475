"""Telemetry scenario for `lanes demo`: one rank is OOM-killed, the others time out in an all-reduce.

Every rank is a real process. The OOM kill takes one of two paths:

- through the kernel (`lanes demo --kernel`, as root with a cgroup v1 memory controller): each rank runs in
  a memory cgroup of 128 MiB (the spec's `host_memory_gib`), the last rank allocates past it, the kernel's
  OOM killer kills it and logs `Memory cgroup out of memory: Killed process <pid> ...`, and the node agent
  reads that line from /dev/kmsg;
- played (everywhere else): the last rank kills itself with SIGKILL, standing in for the OOM killer, and
  the scenario publishes the `Out of memory: Killed process <pid>` line an agent would have read.

The other ranks notice their peer is gone and print PyTorch's NCCL watchdog timeout for the all-reduce they
were in, exactly as a real job would minutes later, and exit 1. The launcher parses their output into
evidence; telemetry correlates it and elects the first error.

Rank 0 checkpoints as it trains (real files with their sha256 and the versions they were trained with),
so the story goes on with recovery: the OOM-killed node is cordoned, the attempt's GPUs are released, and
attempt 2 resumes from the last verified checkpoint on the nodes left and succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import shutil
import sys
import tempfile
from datetime import UTC
from pathlib import Path

from nats.aio.msg import Msg

from lanes_contract.client import LanesClient, publish_encoded
from lanes_contract.codec import decode, encode
from lanes_contract.errors import DecodeError
from lanes_contract.events import (
    EvidenceCategory,
    JobFinding,
    JobStateChanged,
    JobSubmitted,
    JobSubmittedData,
    RankExited,
    RankStarted,
)
from lanes_contract.ids import derived_event_id, new_event_id
from lanes_contract.jobs import JobSpec, JobState, Owners, WorkloadClass
from lanes_contract.streams import TELEMETRY
from lanes_evidence.evidence import evidence_event
from lanes_evidence.parsers import SourceContext, parse_lines
from lanes_runtime.service import Connections

SOURCE = "lanes/demo"
OOM_LIMIT_GIB = 0.125
"""Each rank's memory cgroup when the kernel does the OOM kill: well above a resting rank, far below 1 GiB."""
RENDEZVOUS_DIR = "lanes-demo-rendezvous-"

# Each rank writes its pid where its peers can see it. Rank 0 trains, printing its step and checkpointing
# every 20 steps (a real file and its sha256, with the versions it trained with). The last rank is the
# victim: once the step-40 checkpoint is written it allocates and dies; the others spin in "the all-reduce"
# until its process is gone, then the NCCL watchdog reports the timeout. A resumed attempt (LANES_ATTEMPT
# > 1) trains from LANES_RESUME_STEP to the last step and succeeds.
_RANK_PROGRAM = """
import hashlib, os, signal, sys, time
from datetime import datetime, timezone
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
attempt = int(os.environ["LANES_ATTEMPT"])
checkpoints = os.environ["LANES_CHECKPOINT_DIR"]
where = os.path.join(sys.argv[1], os.environ["LANES_JOB_ID"], str(attempt))
os.makedirs(where, exist_ok=True)
os.makedirs(checkpoints, exist_ok=True)
with open(os.path.join(where, f"rank{rank}.pid"), "w") as out:
    out.write(str(os.getpid()))
print("lanes: communicator ready", flush=True)
LAST_STEP, EVERY, STEP_S = 80, 20, 0.02
VERSIONS = (("model_version", "LANES_MODEL_VERSION"), ("data_version", "LANES_DATA_VERSION"),
            ("config_version", "LANES_CONFIG_VERSION"), ("image", "LANES_IMAGE"))

def checkpoint(step):
    payload = f"weights at step {step}".encode() * 4096
    path = os.path.join(checkpoints, f"step-{step}.pt")
    with open(path + ".tmp", "wb") as out:
        out.write(payload)
    os.replace(path + ".tmp", path)
    versions = " ".join(f"{key}={os.environ[env]}" for key, env in VERSIONS if env in os.environ)
    digest = hashlib.sha256(payload).hexdigest()
    print(f"lanes: checkpoint saved step={step} path={path} digest=sha256:{digest} {versions}", flush=True)

def train_step(step):
    time.sleep(STEP_S)
    if rank == 0 and step % 5 == 0:
        print(f"lanes: step {step}", flush=True)
    if rank == 0 and step % EVERY == 0:
        checkpoint(step)

if attempt > 1:
    for step in range(int(os.environ.get("LANES_RESUME_STEP", "0")) + 1, LAST_STEP + 1):
        train_step(step)
    sys.exit(0)
victim = world - 1
if rank == victim:
    while not os.path.exists(os.path.join(checkpoints, "step-40.pt")):
        time.sleep(0.005)
    time.sleep(0.25)  # half-way to the next checkpoint: the steps since step 40 are lost
    ballast = []  # the allocations that tip the rank over its memory (each page written, so it counts)
    for _ in range(32):
        ballast.append(b"x" * (16 * 1024 * 1024))
    os.kill(os.getpid(), signal.SIGKILL)  # no memory limit (the played path): the OOM killer's signal
pid_file = os.path.join(where, f"rank{victim}.pid")
step = 0
while True:
    try:
        os.kill(int(open(pid_file).read()), 0)
    except (FileNotFoundError, ValueError):
        pass
    except ProcessLookupError:
        break
    if step < LAST_STEP:
        step += 1
        train_step(step)
    else:
        time.sleep(0.005)
now = datetime.now(timezone.utc)
print(
    f"[rank{rank}]:[E{now:%m%d %H:%M:%S.%f} {os.getpid()} torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:616]"
    f" [Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE,"
    f" NumelIn=262144000, NumelOut=262144000, Timeout(ms)=600000) ran for 600047 milliseconds before timing out.",
    file=sys.stderr, flush=True,
)
sys.exit(1)
"""


class _Watch:
    """What the scenario needs to see on the job's timeline: pids, the victim's exit, findings, states."""

    def __init__(self) -> None:
        self.pids: dict[tuple[int, int], tuple[str, int]] = {}
        """(attempt, rank) -> (node, pid): a later attempt's ranks must not stand in for the killed one."""
        self.killed: asyncio.Future[RankExited] = asyncio.get_running_loop().create_future()
        self.finding: JobFinding | None = None
        self.oom_elected = asyncio.Event()
        self.released = asyncio.Event()
        self.succeeded: set[int] = set()
        self.resumed = asyncio.Event()
        """A later attempt succeeded and released its GPUs: the job recovered."""

    async def on_message(self, msg: Msg) -> None:
        with contextlib.suppress(DecodeError):
            event = decode(msg.subject, msg.headers, msg.data)
            if isinstance(event, RankStarted) and event.rank is not None and event.node and event.data.pid:
                self.pids[event.attempt or 1, event.rank] = (event.node, event.data.pid)
            elif isinstance(event, RankExited) and event.data.signal == 9 and not self.killed.done():  # noqa: PLR2004
                self.killed.set_result(event)
            elif isinstance(event, JobFinding) and event.data.first_error is not None:
                if self.finding is None or event.data.version > self.finding.data.version:
                    self.finding = event
                if event.data.first_error.category == EvidenceCategory.OOM_KILL:
                    self.oom_elected.set()
            elif isinstance(event, JobStateChanged) and event.data.to_state is JobState.SUCCEEDED:
                self.succeeded.add(event.attempt or 1)
            elif isinstance(event, JobStateChanged) and event.data.to_state is JobState.RELEASED:
                if (event.attempt or 1) == 1:
                    self.released.set()
                elif event.attempt in self.succeeded:
                    self.resumed.set()


async def oom_killed_rank(
    conns: Connections,
    *,
    workers: int = 3,
    timeout_s: float = 90.0,
    wait_for_recovery: bool = True,
    kernel_delay_s: float = 0.0,
    through_kernel: bool = False,
) -> str:
    """A `workers`-rank training job, one rank per node, whose last rank is OOM-killed; returns its job id.

    `through_kernel`: the kernel kills the rank in its memory cgroup and the launcher (following /dev/kmsg)
    reports the line; otherwise the kill and its line are played. `kernel_delay_s` holds the played line
    back that long after the kill, as a slow node agent or a busy dmesg would: recovery must still blame the
    killed rank's node, never a node that merely waited.

    With `wait_for_recovery`, it returns once the recovery service has resumed the job in a later attempt
    (from its verified checkpoint, on the nodes left) and that attempt succeeded and released its GPUs.
    """
    job_id = f"demo-oom-{new_event_id()[-12:]}"
    scratch = Path(tempfile.mkdtemp(prefix=RENDEZVOUS_DIR))
    watch = _Watch()
    sub = await conns.nc.subscribe(f"lanes.job.{job_id}.>", cb=watch.on_message)
    try:
        spec = JobSpec(
            name="demo-oom",
            workload_class=WorkloadClass.TRAINING,
            workers=workers,
            gpus_per_worker=4,
            command=(sys.executable, "-c", _RANK_PROGRAM, str(scratch)),
            image="trainer:1.4",
            model_version=_digest("llama-mini weights"),
            data_version=_digest("tokens shard 0-127"),
            config_version=_digest("lr=3e-4 batch=512"),
            checkpoint_location=str(scratch / "checkpoints" / job_id),
            owners=Owners(algorithm="ml-oncall", host="node-oncall"),
            host_memory_gib=OOM_LIMIT_GIB if through_kernel else None,
        )
        client = LanesClient(conns.nc, SOURCE)
        await client.publish(JobSubmitted(source=SOURCE, jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec)))
        async with asyncio.timeout(timeout_s):
            killed = await watch.killed
            if not through_kernel:
                await asyncio.sleep(kernel_delay_s)  # the kernel line is late; everything else goes on meanwhile
                await _kernel_reports_the_oom_kill(conns, watch, killed)
            await watch.released.wait()
            await watch.oom_elected.wait()  # findings are re-elected as late evidence arrives
            if wait_for_recovery:
                await watch.resumed.wait()
    finally:
        await sub.unsubscribe()
        shutil.rmtree(scratch, ignore_errors=True)
    return job_id


def _digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


async def _kernel_reports_the_oom_kill(conns: Connections, watch: _Watch, killed: RankExited) -> None:
    """Publish the kernel log line of the OOM kill, as the victim node's agent would read it from dmesg."""
    node, pid = watch.pids[killed.attempt or 1, killed.rank or 0]
    at = killed.time.astimezone(UTC)
    line = (
        f"{at:%b} {at.day:2d} {at:%H:%M:%S} {node} kernel: [{at.timestamp() % 1e6:.6f}] Out of memory: Killed process"
        f" {pid} (python3) total-vm:245638812kB, anon-rss:262144kB, file-rss:0kB, shmem-rss:0kB, UID:0"
        " pgtables:3964kB oom_score_adj:0"
    )
    # A kernel line knows the pid, not the rank or the job: telemetry matches the pid to the rank.
    context = SourceContext(origin=f"{node}/kern.log", node=node, year=at.year, tz=UTC)
    for number, evidence in enumerate(parse_lines([line], context)):
        event = evidence_event(evidence, source=f"agent/{node}", node=node, time=at)
        event = event.model_copy(update={"id": derived_event_id(killed.id, event.type, str(number))})
        await publish_encoded(conns.nc.jetstream(), encode(event), stream=TELEMETRY.name)
