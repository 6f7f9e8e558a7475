"""A local launcher: the node agent of `lanes demo` and `lanes up`, running each rank as a real process.

It reads placements from the job timeline, starts one OS process per rank with the usual torchrun-style
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for torch.distributed's env://
rendezvous, LANES_JOB_ID) and publishes each rank's start, rendezvous, communicator readiness (the rank prints
READY_MARKER or NCCL's init line) and exit. A rank that cannot be started exits with the OS error
(`start_error`). It terminates an attempt's ranks when the lifecycle cancels it or declares it partially
failed, and SIGKILLs any still there after a grace period (`killed_after_grace_s` on its exit).

Each rank runs at most once: its record in the agent's ledger (`ledger.py`) is written before the process
starts, so a placement redelivered after an outage or after the agent's own restart re-publishes what
happened instead of running the rank again, and a restarted agent settles the ranks its earlier self left.
What it forgot with its memory (the job's spec, a stop already decided) it reads back from the log. The
ledger also says which of a rank's start, exit and fault the log holds, so a run however much later never
publishes them again; event ids derive from the placement, so a repeat within JetStream's window is stored once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from datetime import UTC
from pathlib import Path
from typing import Any

import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from lanes_agent import netns
from lanes_agent.cgroups import MemoryCgroups
from lanes_agent.kernel_follower import KernelLogFollower
from lanes_agent.ledger import RankLedger, RankRecord, process_start, reclaim
from lanes_agent.node_reports import Heartbeats, LinkWatch
from lanes_agent.rank_output import LOOPBACK, READY_MARKER, communicator_ready, listening_endpoint, progress_line
from lanes_agent.ras_poll import RasPolling, StallWatch, ask_ras
from lanes_contract.client import publish_encoded
from lanes_contract.codec import decode, encode
from lanes_contract.errors import DecodeError, PoisonEventError
from lanes_contract.events import (
    AttemptRequested,
    CheckpointSaved,
    CheckpointSavedData,
    CommunicatorReady,
    CommunicatorReadyData,
    Event,
    EvidenceCategory,
    EvidenceData,
    Heartbeat,
    HeartbeatData,
    JobPlaced,
    JobStateChanged,
    JobSubmitted,
    Lane,
    RankAssignment,
    RankExited,
    RankExitedData,
    RankStarted,
    RankStartedData,
    RendezvousDone,
    RendezvousDoneData,
    ReplicaListening,
    ReplicaListeningData,
    derive,
    utc_now,
)
from lanes_contract.ids import derived_event_id
from lanes_contract.jobs import JobSpec, JobState
from lanes_contract.signing import Keyring, SignatureError, verified_signer
from lanes_contract.streams import JOBS, TELEMETRY
from lanes_evidence.dump_files import take_rank_dump
from lanes_evidence.evidence import Evidence, evidence_event
from lanes_evidence.flight_recorder import DUMP_PREFIX, RECORDING
from lanes_evidence.parsers import LogParser, SourceContext
from lanes_evidence.progress_lines import TimingBatch
from lanes_runtime import decision
from lanes_runtime.consumer import ConsumerSpec
from lanes_runtime.delivery import BatchPull, StoppedError, carry_out, hold_through_outages, pull_batches, settle
from lanes_runtime.failures import classify
from lanes_runtime.health import Readiness
from lanes_runtime.metrics import ConsumerMetrics
from lanes_runtime.settings import configured_keyring
from lanes_runtime.upkeep import DurableUpkeep, FileFloors

_PIDS_KEPT = 65_536
STOP_GRACE_S = 10.0
"""How long a stopped rank has between SIGTERM and SIGKILL."""
HEARTBEAT_S = 10.0
"""How often an agent says it is alive (with what it runs and the node's inventory)."""
# What a rank runs when the spec names no command: ready at once, a little real CPU work, a clean exit.
DEFAULT_RANK_PROGRAM = (
    "import os, hashlib\n"
    f"print({READY_MARKER!r}, flush=True)\n"
    "rank = int(os.environ['RANK'])\n"
    "digest = b'lanes'\n"
    "for _ in range(20000):\n"
    "    digest = hashlib.sha256(digest + bytes([rank % 256])).digest()\n"
    "print(f\"rank {rank}/{os.environ['WORLD_SIZE']} done {digest.hex()[:12]}\")\n"
)
_STOP_RANKS = frozenset({JobState.CANCELLING, JobState.CANCELLED, JobState.PARTIALLY_FAILED, JobState.FAILED})
"""States in which the launcher terminates the attempt's ranks (and starts none of those not yet started):
cancelled, or (like torchrun's elastic agent) a rank failed, so the rest of the gang is torn down."""
_ATTEMPT_OVER = _STOP_RANKS | {JobState.SUCCEEDED, JobState.RELEASED, JobState.AWAITING_MANUAL}
"""States after which none of the attempt's ranks may start (nor may any of an earlier attempt). Only these:
the lifecycle may not have folded the placement yet (the job still `queued`, or `retrying`, which carries the
new attempt's number) when a restarted agent looks."""
log = structlog.get_logger(__name__)

LAUNCHER_INPUTS = ConsumerSpec(
    durable="launcher-local",
    stream=JOBS,
    subjects=(
        "lanes.job.*.submitted",
        "lanes.job.*.attempt_requested",
        "lanes.job.*.placed",
        "lanes.job.*.state_changed",
    ),
    max_deliver=3,
)
"""What the node agent reads; a placement is held (in progress) for as long as its ranks run."""


class LocalLauncher:
    """Runs the ranks placed on a set of (simulated) nodes as local processes."""

    def __init__(
        self,
        nc: NatsClient,
        nodes: frozenset[str],
        *,
        durable: str = "launcher-local",
        stop_grace_s: float = STOP_GRACE_S,
        kernel_log: Path | None = None,
        kernel_log_position: Path | None = None,
        memory_cgroups: MemoryCgroups | None = None,
        state_dir: Path | None = None,
        networks: netns.NodeNetworks | None = None,
        heartbeat_s: float = HEARTBEAT_S,
        nvidia_smi: str | None = None,
        keyring: Keyring | None = None,
        ras: RasPolling | None = None,
    ) -> None:
        self._nc = nc
        self._ras = ras
        """Ask NCCL's RAS when a rank's collective stalls (None: never)."""
        self._ras_asked: set[tuple[str, int]] = set()
        """The attempts RAS has been asked about: once per attempt, however many of its ranks stall here."""
        self._ras_polls: set[asyncio.Task[None]] = set()
        self._keyring = keyring or configured_keyring()
        """Placements and stops are acted on only if signed by an identity that may say them (None: unchecked)."""
        self._running: Counter[str] = Counter()
        """Ranks running now, per node (what the heartbeat reports)."""
        self._networks = networks
        """Each node's network namespace (made by the caller), or None: the nodes share the host's network."""
        self._state_dir = state_dir
        """Where the ledger lives (survives restarts); None: a temporary one, for a launcher that never restarts."""
        self._ledger: RankLedger | None = None
        self._dumps: Path | None = None
        """Where the ranks write their Flight Recorder dumps (beside the ledger), to be read as their evidence."""
        self._incarnation = uuid.uuid4().hex
        self._runs: dict[str, asyncio.Task[RankRecord]] = {}
        """The ranks this run of the agent is running, by ledger key: a redelivered placement waits for them."""
        self._cgroups = memory_cgroups or MemoryCgroups()
        self._cgroups_missing: str | None = None
        """Why specs' host memory limits cannot be enforced here (found at the first spec that sets one)."""
        self._cgroups_checked = False
        self._ranks_by_pid: dict[int, RankRecord] = {}
        """The ranks this agent (or its earlier self) started, by pid: whose process a kernel line names."""
        self._stop_grace_s = stop_grace_s
        self._js = nc.jetstream()
        self._nodes = nodes
        self._spec = dataclasses.replace(LAUNCHER_INPUTS, durable=durable)
        self._kernel = (
            None
            if kernel_log is None
            else KernelLogFollower(
                kernel_log,
                kernel_log_position,
                nodes,
                self._ranks_by_pid,
                publish_held=self._publish_held,
                publish_now=self._publish_now,
            )
        )
        self._beats = Heartbeats(
            self.name,
            nodes,
            self._running,
            lambda: "off" if self._kernel is None else self._kernel.state,
            send=self._publish_now,
            interval_s=heartbeat_s,
            nvidia_smi=nvidia_smi,  # the nvidia-smi that inventories the GPUs (default: the one on PATH, if any)
        )
        self._specs: dict[str, JobSpec] = {}
        self._resume_steps: dict[tuple[str, int], int] = {}
        self._procs: dict[tuple[str, int], set[asyncio.subprocess.Process]] = {}
        self._stopping: set[tuple[str, int]] = set()
        self._rendezvous_ports: dict[tuple[str, int], int] = {}
        self._killed: set[asyncio.subprocess.Process] = set()
        """Ranks SIGKILLed because they outlived the stop grace (their exit says so)."""

    @property
    def name(self) -> str:
        """The durable consumer name."""
        return self._spec.durable

    async def run(self, stop: asyncio.Event) -> None:
        """Launch the ranks of every placement on our nodes until `stop` is set."""
        with contextlib.ExitStack() as scratch:
            directory = self._state_dir or Path(
                scratch.enter_context(tempfile.TemporaryDirectory(prefix="lanes-agent-"))
            )
            self._ledger = RankLedger(directory)
            self._dumps = directory / "flight-recorder"
            settled = await asyncio.to_thread(self._settle_earlier_runs, self._ledger)
            await self._report_settled(settled)
            try:
                await self._consume(stop, directory)
            finally:
                for poll in self._ras_polls:
                    poll.cancel()
                await asyncio.gather(*self._ras_polls, return_exceptions=True)

    def _settle_earlier_runs(self, ledger: RankLedger) -> list[RankRecord]:
        """Kill what an earlier run of this agent left running, and record those ranks as lost (at most once)."""
        ledger.prune()
        settled = []
        for record in ledger.unfinished():
            if record.pid is not None:
                self._remember_pid(record)  # kernel lines about it that this run has not read are still its own
            settled.append(ledger.put(reclaim(record)))
            lost = (settled[-1].exit or {}).get("lost")
            log.warning("rank left by an earlier run of this agent", job_id=record.job_id, rank=record.rank, lost=lost)
        return settled

    async def _report_settled(self, settled: list[RankRecord]) -> None:
        """Report the lost ranks now, from their placement on the log, rather than when it is redelivered.

        Its redelivery (the earlier run never acknowledged it) finds them reported in the ledger and publishes
        nothing twice; if the bus is away now, that redelivery is what reports them.
        """
        for record in settled:
            try:
                placed = await self._last_event(f"lanes.job.{record.job_id}.placed")
                if not isinstance(placed, JobPlaced) or placed.id != record.placement:
                    continue  # a later placement of the job has superseded this one; its redelivery reports it
                (assignment,) = [a for a in placed.data.assignments if a.rank == record.rank]
                await self._report_exit(placed, assignment, record)
            except Exception as exc:  # noqa: BLE001 - the placement's redelivery reports it instead
                log.warning("lost rank not reported yet", job_id=record.job_id, rank=record.rank, error=str(exc))

    def _remember_pid(self, record: RankRecord) -> None:
        assert record.pid is not None  # noqa: S101 - only started ranks are remembered
        self._ranks_by_pid[record.pid] = record
        if len(self._ranks_by_pid) > _PIDS_KEPT:  # the oldest go first (dicts keep insertion order)
            del self._ranks_by_pid[next(iter(self._ranks_by_pid))]

    async def _consume(self, stop: asyncio.Event, state: Path) -> None:
        # The durable is kept as a service's is (`lanes_runtime.upkeep`): deleted or re-filtered by someone else,
        # it is made again after its ack floor, recorded beside the ledger (an agent has no database).
        readiness = Readiness(self.name, ConsumerMetrics.for_consumer(self.name).ready)
        upkeep = DurableUpkeep(self._js, FileFloors(state / "floors"), self._spec, readiness)
        await upkeep.provision()
        sub = await BatchPull.bind(self._nc, JOBS.name, self._spec.durable)
        running: set[asyncio.Task[None]] = set()
        watchers = [self._beats.run(stop)]
        if self._kernel is not None:
            watchers.append(self._kernel.follow(stop))
        if self._networks is not None:
            watchers.append(LinkWatch(self._networks, self._publish_held).run(stop))
        for watcher in watchers:
            task = asyncio.create_task(watcher)
            running.add(task)
            task.add_done_callback(running.discard)
        try:
            async with upkeep.kept(stop):
                async for msgs in pull_batches(sub, 16, stop, consumer=self.name, readiness=readiness):
                    # Each message runs on its own (a placement's ranks live for as long as the job does); each
                    # ends with an explicit decision from the runtime's `decide`, never a silent drop.
                    for msg in msgs:
                        task = asyncio.create_task(self._handle(msg, stop))
                        running.add(task)
                        task.add_done_callback(running.discard)
        finally:
            for attempt_key in list(self._procs):
                self._stop_attempt(attempt_key)  # no rank outlives its launcher
            # Their ends go to the ledger (the placements' redeliveries report them to the next run), and
            # stragglers get their SIGKILL: wait out the grace, then a little more, but no longer.
            runs = set(self._runs.values())
            if runs:
                await asyncio.wait(runs, timeout=self._stop_grace_s + 2.0)
            for unfinished in (*running, *runs):
                unfinished.cancel()
            await asyncio.gather(*running, *runs, return_exceptions=True)

    async def _handle(self, msg: Msg, stop: asyncio.Event) -> None:
        """Apply one message, holding it through outages, and carry out `decide`'s verdict on what happened.

        Applying a placement again after an outage is safe: the ledger runs each rank at most once.
        """
        try:
            await hold_through_outages(lambda: self._apply(msg), self._spec, held=[msg], stop=stop)
            outcome: decision.Outcome = decision.Processed()
        except StoppedError:
            return  # stopping: the message comes back after ack_wait, to the next run of the agent
        except Exception as exc:  # noqa: BLE001 - every failure becomes an explicit decision
            outcome = classify(exc)
        await carry_out(self._js, msg, decision.decide(outcome, msg.metadata.num_delivered, self._spec), self._spec)

    async def _apply(self, msg: Msg) -> None:
        if self._keyring is not None:
            try:
                verified_signer(msg.subject, msg.headers, msg.data, self._keyring)
            except SignatureError as exc:
                # Not ours to dead-letter either: the services verify the same message and dead-letter it.
                log.warning("launcher skips a forged event", subject=msg.subject, reason=str(exc))
                return
        try:
            event = decode(msg.subject, msg.headers, msg.data)
        except DecodeError as exc:
            # Not ours to dead-letter: the services' consumers see the same message and dead-letter it.
            log.warning("launcher skips an undecodable message", error=str(exc))
            return
        if isinstance(event, JobSubmitted):
            self._specs[str(event.jobid)] = event.data.spec
        elif isinstance(event, AttemptRequested) and event.data.resume_step is not None:
            self._resume_steps[(event.job_key, event.attempt or 1)] = event.data.resume_step
        elif isinstance(event, JobStateChanged) and event.data.to_state in _STOP_RANKS:
            self._stop_attempt((str(event.jobid), event.attempt or 1))
        elif isinstance(event, JobPlaced):
            mine = [a for a in event.data.assignments if a.node in self._nodes]
            spec = await self._job_spec(event) if mine else None
            if mine and spec is not None and spec.managed_by is None:  # observed jobs run elsewhere
                world = len(event.data.assignments)
                await asyncio.gather(*(self._rank(event, spec, a, world, msg) for a in mine))

    async def _job_spec(self, placed: JobPlaced) -> JobSpec | None:
        """The placed job's spec; when this run of the agent has not seen the job, what the log says of it.

        After a restart the submission (and any stop) was acknowledged by the earlier run: the job's last
        `submitted`, `attempt_requested` and `state_changed` events give back its spec, the step its attempt
        resumes from, and whether that attempt is already over (then none of its ranks is started).
        """
        job_id, attempt = str(placed.jobid), placed.attempt or 1
        if job_id in self._specs:
            return self._specs[job_id]
        submitted = await self._last_event(f"lanes.job.{job_id}.submitted")
        if not isinstance(submitted, JobSubmitted):
            return None
        requested = await self._last_event(f"lanes.job.{job_id}.attempt_requested")
        if isinstance(requested, AttemptRequested) and requested.data.resume_step is not None:
            self._resume_steps[(placed.job_key, requested.attempt or 1)] = requested.data.resume_step
        changed = await self._last_event(f"lanes.job.{job_id}.state_changed")
        if isinstance(changed, JobStateChanged) and (
            (changed.attempt or 1) > attempt or (changed.attempt == attempt and changed.data.to_state in _ATTEMPT_OVER)
        ):
            self._stopping.add((job_id, attempt))
        self._specs[job_id] = submitted.data.spec
        return submitted.data.spec

    async def _last_event(self, subject: str) -> Event | None:
        try:
            raw = await self._js.get_last_msg(JOBS.name, subject)
        except NotFoundError:
            return None
        try:
            return decode(raw.subject or subject, raw.headers, raw.data or b"")
        except DecodeError:
            return None  # the services dead-letter it; for the agent the job is unknown

    async def _rank(self, placed: JobPlaced, spec: JobSpec, assignment: RankAssignment, world: int, msg: Msg) -> None:
        """Run one rank of a placement at most once, then report how it ended (again, if this is a redelivery)."""
        assert self._ledger is not None  # noqa: S101 - set by run()
        attempt_key = (str(placed.jobid), placed.attempt or 1)
        record = self._ledger.get(placed.id, assignment.rank)
        if record is None:
            if attempt_key in self._stopping:
                return  # stopped before this rank was started: never start it
            intent = RankRecord(
                placement=placed.id,
                rank=assignment.rank,
                job_id=attempt_key[0],
                attempt=attempt_key[1],
                node=assignment.node,
                incarnation=self._incarnation,
            )
            record = self._ledger.put(intent)  # before the process exists: a crash from here on never reruns it
            run = asyncio.create_task(self._execute(placed, spec, assignment, world, record))
            self._runs[record.key] = run
            run.add_done_callback(lambda _: self._runs.pop(intent.key, None))
        if record.exit is None:
            running = self._runs.get(record.key)
            if running is None:  # an earlier run's, not settled yet: settle it now
                record = self._ledger.put(await asyncio.to_thread(reclaim, record))
            else:
                record = await _holding(msg, running)
        await self._report_exit(placed, assignment, record)

    async def _report_exit(self, placed: JobPlaced, assignment: RankAssignment, record: RankRecord) -> None:
        """Publish the rank's start and exit, each unless the log holds it already (`_report_once`).

        A rank the agent could not start, or lost in its own restart, is the platform's fault: the agent says
        so as evidence in the platform lane, so the finding names it rather than the gang's consequences.
        """
        assert record.exit is not None  # noqa: S101 - only ended ranks are reported
        data = RankExitedData.model_validate(record.exit)
        keys = {"source": f"agent/{assignment.node}", "node": assignment.node, "rank": assignment.rank}
        rank_key = str(assignment.rank)
        if record.pid is not None:
            started = derive(RankStarted, placed, key=rank_key, data=RankStartedData(pid=record.pid), **keys)
            record = await self._report_once(record, started, JOBS.name)
        fault = data.start_error or data.lost
        if fault is not None:
            what = "could not be started" if data.start_error else "was lost by its agent"
            said = EvidenceData(
                category=EvidenceCategory.AGENT_FAULT,
                summary=f"rank {assignment.rank} {what}: {fault}"[:1024],
                origin="agent",
                pid=record.pid,
            )
            found = Evidence(data=said, time=utc_now(), node=assignment.node)
            fault_said = _rank_evidence(placed, assignment, found, "agent_fault")
            record = await self._report_once(record, fault_said, TELEMETRY.name)
        lane = {"lane": Lane.PLATFORM} if fault is not None else {}
        exited = derive(RankExited, placed, key=rank_key, data=data, **lane, **keys)
        await self._report_once(record, exited, JOBS.name)
        if data.start_error is not None:
            msg_text = f"rank {assignment.rank} of job {placed.jobid} cannot be started on {assignment.node}: {fault}"
            raise PoisonEventError(msg_text)

    async def _execute(
        self, placed: JobPlaced, spec: JobSpec, assignment: RankAssignment, world: int, record: RankRecord
    ) -> RankRecord:
        """Start the rank's process, report it as it runs, and return its record with the exit."""
        assert self._ledger is not None  # noqa: S101 - set by run()
        ledger = self._ledger
        command = list(spec.command) or [sys.executable, "-c", DEFAULT_RANK_PROGRAM]
        local_rank = [a.rank for a in placed.data.assignments if a.node == assignment.node].index(assignment.rank)
        env = os.environ | {
            "RANK": str(assignment.rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(local_rank),
            "LANES_JOB_ID": str(placed.jobid),
            "LANES_ATTEMPT": str(placed.attempt or 1),
            "LANES_NODE": assignment.node,
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, assignment.gpus)),
        }
        attempt_key = (str(placed.jobid), placed.attempt or 1)
        # torch.distributed's env:// rendezvous: every rank of the attempt meets rank 0 at one endpoint. The
        # simulated nodes share this host, so it is a free local port, the same for the attempt's ranks.
        port = self._rendezvous_ports.setdefault(attempt_key, _free_port())
        first = next(a.node for a in placed.data.assignments if a.rank == 0)
        # LANES_NODE_ADDRESS: where the node's servers listen, so others reach them (a replica, the router).
        env |= {
            "MASTER_ADDR": self._address(first),
            "MASTER_PORT": str(port),
            "LANES_NODE_ADDRESS": self._address(assignment.node),
        }
        if self._networks is not None and first in self._networks.links:
            # Each node in its own namespace: rank 0 listens on its node's address, and every rank's traffic
            # leaves through its node's own interface, across the bridge.
            env |= {"GLOO_SOCKET_IFNAME": netns.INTERFACE, "NCCL_SOCKET_IFNAME": netns.INTERFACE}
            command = self._networks.command(assignment.node, command)
        # PyTorch's Flight Recorder: every rank records its collectives, and dumps them (on a watchdog timeout, or
        # as the drill workload does when a collective fails) where this agent reads them after the rank ends.
        dumps = self._dump_prefix(placed)
        env = (
            _flight_recorder_environment(dumps)
            | env
            | _spec_environment(spec, self._resume_steps.get((placed.job_key, placed.attempt or 1)))
            | {DUMP_PREFIX: str(dumps)}  # always the agent's: it reads the dumps there
        )
        keys = {"source": f"agent/{assignment.node}", "node": assignment.node, "rank": assignment.rank}
        group = self._rank_cgroup(placed, assignment, spec.host_memory_gib)
        try:
            proc = await asyncio.create_subprocess_exec(
                *command,
                env=env,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                # Its own process group: a rank's whole tree (torchrun and its workers) can be killed at once.
                start_new_session=True,
                # Joins the cgroup between fork and exec, so nothing the rank allocates escapes its limit.
                preexec_fn=MemoryCgroups.join(group) if group else None,
            )
        # Cannot run here (no binary, no room to join its cgroup): a bad placement for this node, not an outage.
        except (OSError, subprocess.SubprocessError) as exc:
            self._stop_attempt(attempt_key)
            # The rank's exit says it never ran, so the job fails instead of waiting for it forever; the
            # placement is dead-lettered with the same reason. Its one piece of evidence is the agent's fault.
            never_ran = RankExitedData(exit_code=None, start_error=f"{type(exc).__name__}: {exc}"[:1024], evidence=1)
            return ledger.put(dataclasses.replace(record, exit=never_ran.model_dump(mode="json")))
        record = ledger.put(dataclasses.replace(record, pid=proc.pid, pid_start=process_start(proc.pid)))
        self._running[assignment.node] += 1
        self._procs.setdefault(attempt_key, set()).add(proc)
        self._remember_pid(record)
        if attempt_key in self._stopping:  # stopped while this process was being spawned
            proc.terminate()
        rank_key = str(assignment.rank)
        started = derive(RankStarted, placed, key=rank_key, data=RankStartedData(pid=proc.pid), **keys)
        record = await self._report_once(record, started, JOBS.name, held=True)
        # The local launcher's rendezvous is static: RANK and WORLD_SIZE are known when the process starts.
        met = derive(RendezvousDone, placed, key=rank_key, data=RendezvousDoneData(world_size=world), **keys)
        await self._publish_held(met, JOBS.name)
        counted = record

        def count(published: int) -> None:
            nonlocal counted
            counted = ledger.put(dataclasses.replace(counted, evidence=published))

        reader = asyncio.create_task(self._watch_output(proc, placed, assignment, keys, count))
        try:
            code = await proc.wait()
        finally:
            self._running[assignment.node] -= 1
        published = await reader  # its events come before the exit, as they happened
        self._procs[attempt_key].discard(proc)
        exit_data = RankExitedData(
            exit_code=code if code >= 0 else None,
            signal=None if code >= 0 else -code,
            evidence=published,
            killed_after_grace_s=self._stop_grace_s if proc in self._killed else None,
        )
        self._killed.discard(proc)
        if group is not None:
            MemoryCgroups.remove(group)
        log.info("rank finished", job_id=placed.jobid, rank=assignment.rank, node=assignment.node, exit_code=code)
        return ledger.put(dataclasses.replace(counted, exit=exit_data.model_dump(mode="json")))

    async def _report_once(self, record: RankRecord, event: Event, stream: str, *, held: bool = False) -> RankRecord:
        """Publish one of the rank's own events unless the log holds it; return the record that says it does.

        The ledger decides, never JetStream's duplicate window: a later run (an agent restarted an hour on)
        would otherwise store its start a second time. An event whose publishing began but was never
        acknowledged (the agent died in between, or a try failed after it landed) is looked for on the log
        before it is sent again. `held`: ride out outages here, as a running rank's reports do; otherwise an
        outage is raised to the placement's handler, which applies the placement again.
        """
        assert self._ledger is not None  # noqa: S101 - set by run()
        if event.id in record.stored:
            return record
        never_sent = event.id not in record.sent
        if never_sent:
            record = self._ledger.put(record.sending(event.id))

        async def publish_unless_stored() -> None:
            nonlocal never_sent
            if not never_sent and await self._holds(event, stream):
                return
            never_sent = False
            await publish_encoded(self._js, encode(event), stream=stream)

        if held:
            await hold_through_outages(publish_unless_stored, self._spec)
        else:
            await publish_unless_stored()
        return self._ledger.put(record.holding(event.id))

    async def _holds(self, event: Event, stream: str) -> bool:
        """Whether the log holds `event`: its id among the events on its subject in LANES_JOBS.

        The subject holds only this job's events of that kind, so the walk is short. A telemetry subject
        holds all of a node's evidence: that is not walked, and telemetry's consumer skips an id it has
        processed.
        """
        if stream != JOBS.name:
            return False
        subject, after = event.nats_subject(), 0
        while True:
            try:
                found = await self._js.get_msg(JOBS.name, seq=after + 1, subject=subject, next=True)
            except NotFoundError:
                return False
            with contextlib.suppress(DecodeError):  # not an event at all: not ours either
                if decode(found.subject or subject, found.headers, found.data or b"").id == event.id:
                    return True
            after = found.seq or after + 1

    async def _publish_now(self, event: Event, stream: str) -> None:
        """Publish once: an outage is the caller's to handle (a beat is dropped, the next says the same)."""
        await publish_encoded(self._js, encode(event), stream=stream)

    async def _publish_held(self, event: Event, stream: str) -> None:
        """Publish what a running rank reports; while the bus is away, keep trying (the rank runs on regardless).

        Dropping it would lose evidence; raising would abandon a live rank. Only a refusal that is not an
        outage (a permission, a bad event) is raised.
        """
        encoded = encode(event)
        await hold_through_outages(lambda: publish_encoded(self._js, encoded, stream=stream), self._spec)

    async def _watch_output(
        self,
        proc: asyncio.subprocess.Process,
        placed: JobPlaced,
        assignment: RankAssignment,
        keys: dict[str, Any],
        count: Callable[[int], None],
    ) -> int:
        """Tail the rank's output as a node agent tails logs: the ready marker, and evidence for telemetry.

        Evidence from a rank's output is that rank's: it carries the job, attempt, rank and pid of its producer,
        so telemetry never has to guess them from the node and the time. Returns how many evidence events it
        published (the rank's exit says so, and telemetry knows when it has heard all of them).
        """
        assert proc.stdout is not None and proc.stderr is not None  # noqa: PT018, S101 - always started with pipes
        rank_key = str(assignment.rank)
        # The output is read as it is written: its year-less timestamps are of this year, in UTC (the agent's clock).
        context = SourceContext(
            origin=f"{placed.jobid}/rank{assignment.rank}",
            node=assignment.node,
            rank=assignment.rank,
            year=utc_now().year,
            tz=UTC,
        )
        parser = LogParser(context)
        lines = published = 0

        async def report(found: list[Evidence]) -> None:
            nonlocal lines, published
            for evidence in found:
                lines += 1
                if evidence.category is EvidenceCategory.RAW:
                    continue  # plain output is not evidence; keep the telemetry stream for what is
                if evidence.category is EvidenceCategory.COLLECTIVE_TIMEOUT:
                    self._ask_ras(placed, assignment, "its collective timed out")
                # The rank's own output names its own process unless the line names another.
                pid = evidence.data.pid or proc.pid
                said = dataclasses.replace(evidence, data=evidence.data.model_copy(update={"pid": pid}))
                await self._publish_held(_rank_evidence(placed, assignment, said, str(lines)), TELEMETRY.name)
                published += 1
                count(published)  # a restarted agent knows how much of this rank's evidence telemetry should have

        async def publish(kind: type[Event], data: Any, key: str) -> None:
            event = derive(kind, placed, key=f"{rank_key}:{key}", data=data, **keys)
            await self._publish_held(event, JOBS.name)

        reported = False  # readiness is said once, on whichever stream says it first
        timings = TimingBatch(time.monotonic())

        async def follow(stream: asyncio.StreamReader, stall: StallWatch, *, hooks: bool) -> None:
            nonlocal reported
            async for raw in stream:
                line = raw.decode(errors="replace")
                endpoint = listening_endpoint(line, self._address(assignment.node)) if hooks else None
                backend = communicator_ready(line)
                if not reported and (backend is not None or endpoint):
                    # A serving replica is ready when its server listens; a training rank when it says so.
                    if endpoint:
                        await publish(
                            ReplicaListening, ReplicaListeningData(endpoint=endpoint, rank=assignment.rank), ""
                        )
                    await publish(
                        CommunicatorReady, CommunicatorReadyData(backend="http" if endpoint else backend or ""), ""
                    )
                    reported = True
                    if backend == "" or endpoint:
                        continue  # Lanes' own marker (and the listening line) is no evidence
                progress = progress_line(line, str(placed.jobid)) if hooks else None
                if isinstance(progress, HeartbeatData):
                    stall.stepped(time.monotonic())
                    if beat := timings.add(progress, time.monotonic()):
                        await publish(Heartbeat, beat, f"step:{beat.step}")
                elif isinstance(progress, CheckpointSavedData):
                    await publish(CheckpointSaved, progress, f"checkpoint:{progress.step}")
                else:
                    await report(parser.feed(line))

        async with self._stall_watch(placed, assignment) as stall:
            await asyncio.gather(follow(proc.stdout, stall, hooks=True), follow(proc.stderr, stall, hooks=False))
        if beat := timings.rest():
            await publish(Heartbeat, beat, f"step:{beat.step}")
        await report(parser.finish())
        # The output has ended, so the rank has: a dump it wrote is whole (the workload renames it into place).
        # Its dump is named as PyTorch names it: the prefix, then the rank.
        await report(
            await asyncio.to_thread(collect_dump, Path(f"{self._dump_prefix(placed)}{assignment.rank}"), context)
        )
        return published

    @contextlib.asynccontextmanager
    async def _stall_watch(self, placed: JobPlaced, assignment: RankAssignment) -> AsyncIterator[StallWatch]:
        """While the rank runs, ask RAS once its steps stop for the stall time (if the agent asks RAS at all)."""
        if self._ras is None:
            yield StallWatch(math.inf)
            return
        watch = StallWatch(self._ras.stall_s)

        async def check(every_s: float) -> None:
            while True:
                await asyncio.sleep(every_s)
                if (silent := watch.stalled(time.monotonic())) is not None:
                    self._ask_ras(placed, assignment, f"it made no step for {silent:.0f} s")

        checking = asyncio.create_task(check(min(1.0, watch.stall_s / 4)))
        try:
            yield watch
        finally:
            checking.cancel()

    def _ask_ras(self, placed: JobPlaced, assignment: RankAssignment, why: str) -> None:
        """Ask NCCL's RAS about the attempt now, in the background, unless it was asked already."""
        attempt_key = (str(placed.jobid), placed.attempt or 1)
        if self._ras is None or attempt_key in self._ras_asked:
            return
        self._ras_asked.add(attempt_key)
        log.info("asking NCCL RAS", job_id=placed.jobid, rank=assignment.rank, because=why)
        poll = asyncio.create_task(self._poll_ras(placed, assignment.node, self._ras))
        self._ras_polls.add(poll)
        poll.add_done_callback(self._ras_polls.discard)

    async def _poll_ras(self, placed: JobPlaced, node: str, polling: RasPolling) -> None:
        """RAS's report on the attempt, published as this node's evidence of it (the ranks as RAS names them)."""
        context = SourceContext(origin=f"{placed.jobid}/ncclras@{node}", node=node, year=utc_now().year, tz=UTC)
        for number, found in enumerate(await ask_ras(polling, context)):
            event = evidence_event(found, source=f"agent/{node}", node=node, time=utc_now())
            derived = derived_event_id(placed.id, event.type, f"ras:{number}")
            event = event.model_copy(update={"id": derived, "jobid": placed.jobid, "attempt": placed.attempt or 1})
            await self._publish_held(event, TELEMETRY.name)

    def _dump_prefix(self, placed: JobPlaced) -> Path:
        """The attempt's Flight Recorder dump prefix (`TORCH_FR_DUMP_TEMP_FILE`); rank r writes `<prefix>r`."""
        assert self._dumps is not None  # noqa: S101 - set by run()
        return self._dumps / f"{placed.jobid}-{placed.attempt or 1}" / "rank_"

    def _rank_cgroup(self, placed: JobPlaced, assignment: RankAssignment, limit_gib: float | None) -> Path | None:
        """The rank's own memory cgroup when its spec sets a limit and this node can make one."""
        if limit_gib is None:
            return None
        if not self._cgroups_checked:
            self._cgroups_checked = True
            self._cgroups_missing = self._cgroups.unavailable()
            if self._cgroups_missing:
                log.warning("ranks run without memory limits", reason=self._cgroups_missing)
        if self._cgroups_missing:
            return None
        name = f"{placed.job_key}-a{placed.attempt or 1}-r{assignment.rank}"
        try:
            return self._cgroups.create(name, limit_gib)
        except OSError as exc:
            log.warning("rank runs without its memory limit", cgroup=name, error=exc.strerror or str(exc))
            return None

    def _address(self, node: str) -> str:
        """The node's address: its namespace's, or the host's loopback when the nodes share its network."""
        if self._networks is not None and node in self._networks.links:
            return self._networks.address(node)
        return LOOPBACK

    def _stop_attempt(self, attempt_key: tuple[str, int]) -> None:
        """Terminate the ranks of a stopped attempt; their exits (signal 15) end the cancellation.

        A rank still there after the grace period is SIGKILLed: a stopped process keeps SIGTERM pending
        forever, and one hung in the kernel or ignoring signals would otherwise hold its GPUs for good.
        """
        self._stopping.add(attempt_key)
        procs = [p for p in self._procs.get(attempt_key, set()) if p.returncode is None]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        if procs:
            asyncio.get_running_loop().call_later(self._stop_grace_s, self._kill_stragglers, procs)

    def _kill_stragglers(self, procs: list[asyncio.subprocess.Process]) -> None:
        for proc in procs:
            if proc.returncode is None:
                self._killed.add(proc)
                log.warning("rank ignored SIGTERM; killing it", pid=proc.pid, grace_s=self._stop_grace_s)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # its whole group: a launcher's workers go with it


def _free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it; released at once for the rank to bind)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_evidence(placed: JobPlaced, assignment: RankAssignment, found: Evidence, key: str) -> Event:
    """`found` as the rank's evidence event: its job, attempt and rank, and an id derived from the placement.

    `key` tells the rank's pieces of evidence apart; a repeat after a redelivery is stored once.
    """
    node = assignment.node
    event = evidence_event(found, source=f"agent/{node}", node=node, time=utc_now())
    derived = derived_event_id(placed.id, event.type, f"{assignment.rank}:{key}")
    return event.model_copy(
        update={"id": derived, "jobid": placed.jobid, "attempt": placed.attempt or 1, "rank": assignment.rank}
    )


def _flight_recorder_environment(prefix: Path) -> dict[str, str]:
    """What turns a rank's Flight Recorder on, unless the agent's own environment says otherwise."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    return dict(RECORDING)


def collect_dump(path: Path, context: SourceContext) -> list[Evidence]:
    """A rank's Flight Recorder dump, taken, as its evidence; an unreadable one is said in the agent's log."""
    found, problem = take_rank_dump(path, context, remove=True)
    if problem is not None:
        log.warning("a rank's Flight Recorder dump cannot be read", problem=problem)
    return found


async def _holding(msg: Msg, run: asyncio.Task[RankRecord]) -> RankRecord:
    """Wait for a running rank, telling JetStream every few seconds that its placement is still in progress."""
    while True:
        done, _ = await asyncio.wait({run}, timeout=10)
        if done:
            return run.result()
        await settle(msg.in_progress())  # a long rank must not make JetStream redeliver its placement


def _spec_environment(spec: JobSpec, resume_step: int | None) -> dict[str, str]:
    """What a rank learns from its spec: the versions it must train with and the step it resumes from."""
    optional = {
        "LANES_MODEL_VERSION": spec.model_version,
        "LANES_DATA_VERSION": spec.data_version,
        "LANES_CONFIG_VERSION": spec.config_version,
        "LANES_CHECKPOINT_DIR": spec.checkpoint_location,
        "LANES_RESUME_STEP": None if resume_step is None else str(resume_step),
    }
    env = {"LANES_IMAGE": spec.image} | {name: value for name, value in optional.items() if value is not None}
    if spec.serving is not None:
        env |= {"LANES_MODEL": spec.serving.model, "LANES_MODEL_VERSION_SERVED": spec.serving.version}
    return env
