"""`lanes run -- <command>`: run any launcher unchanged and put what it does on the Lanes timeline.

The command (torchrun, srun, mpirun, deepspeed, a script) runs with the caller's stdin, environment and
signals; its output is copied through byte for byte and read, line by line, by the evidence parsers. The
wrapper reports the ranks' start and exit (torchelastic's per-rank failure summary, srun's `task N: Exited
with exit code C`) and exits with the command's status. Lanes being down never slows or fails the command:
events go to an outbox file first (see `lanes_observe.outbox`) and are published when NATS answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC
from pathlib import Path
from typing import BinaryIO

from lanes_contract.events import (
    Event,
    EvidenceCategory,
    Heartbeat,
    HeartbeatData,
    RankAssignment,
    RankExitedData,
    utc_now,
)
from lanes_contract.ids import derived_event_id, new_event_id
from lanes_evidence.dump_files import take_rank_dump
from lanes_evidence.evidence import Evidence, evidence_event
from lanes_evidence.flight_recorder import DUMP_PREFIX, RECORDING
from lanes_evidence.parsers import LogParser, SourceContext
from lanes_evidence.progress_lines import TimingBatch, progress_report, step_rank
from lanes_observe import observed
from lanes_observe.outbox import Outbox, Sender

MANAGED_BY = "lanes-run"


def slurm_job_id(cluster: str, slurm_id: int | str) -> str:
    """A Slurm job's Lanes id, `slurm-<cluster>-<id>`: the same whether `lanes run` or the adapter sees it first."""
    return f"slurm-{observed.token(cluster)}-{slurm_id}" if cluster else f"slurm-{slurm_id}"


_SRUN_TASK = re.compile(
    r"task (?P<task>\d+): (?:Exited with exit code (?P<code>\d+)|(?P<killed>Killed)|(?P<terminated>Terminated))"
)
_RANK_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_RETRY_S = 2.0
_LONGEST_RETRY_S = 60.0


def parse_ranks(text: str, *, max_ranks: int) -> tuple[int, ...]:
    """`0-3`, `0,2,5` or `4-7,12` as rank numbers, each below `max_ranks` (checked before any is listed)."""
    bounds: list[tuple[int, int]] = []
    for part in text.split(","):
        found = _RANK_RANGE.match(part.strip())
        if found is None or max(len(found[1]), len(found[2] or "")) > len(str(max_ranks)):
            if found is None:
                msg = f"ranks {_quoted(text)}: expected numbers and ranges such as 0-3,8"
            else:
                msg = f"ranks {_quoted(text)}: rank numbers are below the limit of {max_ranks}"
            raise ValueError(msg)
        first = int(found[1])
        last = int(found[2]) if found[2] else first
        if last < first:
            msg = f"ranks {_quoted(part.strip())}: the range runs backwards (write {last}-{first})"
            raise ValueError(msg)
        if last >= max_ranks:
            msg = f"ranks {_quoted(text)}: rank {last} is beyond the limit of {max_ranks} ranks (0-{max_ranks - 1})"
            raise ValueError(msg)
        bounds.append((first, last))
    if sum(last - first + 1 for first, last in bounds) > max_ranks:
        msg = f"ranks {_quoted(text)}: more than the limit of {max_ranks} ranks"
        raise ValueError(msg)
    return tuple(dict.fromkeys(rank for first, last in bounds for rank in range(first, last + 1)))


def _quoted(text: str, chars: int = 60) -> str:
    """A long input quoted in a message by its start only."""
    return repr(text if len(text) <= chars else text[:chars] + "...")


def _number(value: str, where: str, *, at_most: int) -> int:
    """A count or rank from a launcher's arguments or the environment, at most `at_most` (ValueError naming where)."""
    text = value.strip()
    if not text.isdigit() or len(text) > len(str(at_most)) or int(text) > at_most:
        msg = f"{where}={_quoted(value)}: expected a whole number up to the limit of {at_most}"
        raise ValueError(msg)
    return int(text)


def _option(command: Sequence[str], *names: str) -> str | None:
    """The value of `--name V` or `--name=V` in a launcher's arguments."""
    for index, arg in enumerate(command):
        for name in names:
            if arg == name and index + 1 < len(command):
                return command[index + 1]
            if arg.startswith(f"{name}="):
                return arg.split("=", 1)[1]
    return None


def launcher_kind(command: Sequence[str]) -> str:
    """torchrun, srun, mpirun or plain: how the command reports its ranks."""
    names = [Path(arg).name for arg in command[:3]]
    if "torchrun" in names or "torch.distributed.run" in command[:4]:
        return "torchrun"
    if names and names[0] == "srun":
        return "srun"
    if names and names[0] in {"mpirun", "mpiexec", "deepspeed"}:
        return "mpirun"
    return "plain"


@dataclass(frozen=True)
class RunIdentity:
    """Which job, attempt, node and ranks this run is, and whether it registers the job itself."""

    job_id: str
    attempt: int
    node: str
    ranks: tuple[int, ...]
    world_size: int
    register: bool
    name: str
    kind: str
    slurm: dict[str, str] = field(default_factory=dict)

    @property
    def source(self) -> str:
        """The `ce-source` of this run's events."""
        return f"lanes-run/{self.node}"


def identity_from(
    command: Sequence[str],
    env: Mapping[str, str],
    *,
    job: str | None = None,
    attempt: int | None = None,
    node: str | None = None,
    ranks: str | None = None,
    world_size: int | None = None,
    register: bool | None = None,
    max_ranks: int,
) -> RunIdentity:
    """The run's identity: flags first, then what a scheduler put in the environment, then defaults.

    Rank numbers stay below `max_ranks`, counted before any list is built; a bad one is a ValueError.
    """
    kind = launcher_kind(command)
    slurm_id = env.get("SLURM_JOB_ID")
    node_name = observed.token(node or env.get("SLURMD_NODENAME") or socket.gethostname(), fallback="localhost")
    fresh = f"run-{node_name}-{new_event_id()[-12:]}"
    job_id = job or (slurm_job_id(env.get("SLURM_CLUSTER_NAME", ""), slurm_id) if slurm_id else fresh)
    number = attempt or int(env.get("SLURM_RESTART_COUNT", "0") or 0) + 1
    chosen: tuple[int, ...]
    if ranks:
        chosen = parse_ranks(ranks, max_ranks=max_ranks)
    elif kind == "torchrun":
        per_node = _number(
            _option(command, "--nproc-per-node", "--nproc_per_node") or "1", "--nproc-per-node", at_most=max_ranks
        )
        node_rank = _number(
            _option(command, "--node-rank", "--node_rank") or env.get("SLURM_NODEID", "0") or "0",
            "--node-rank",
            at_most=max_ranks - 1,
        )
        if (node_rank + 1) * per_node > max_ranks:
            last = (node_rank + 1) * per_node - 1
            msg = f"torchrun's ranks {node_rank * per_node}-{last}: beyond the limit of {max_ranks} ranks"
            raise ValueError(msg)
        chosen = tuple(range(node_rank * per_node, (node_rank + 1) * per_node))
    elif kind == "srun":
        tasks = _number(
            _option(command, "-n", "--ntasks") or env.get("SLURM_NTASKS", "1") or "1", "--ntasks", at_most=max_ranks
        )
        chosen = tuple(range(tasks))
    else:
        chosen = (_number(env.get("RANK") or env.get("SLURM_PROCID") or "0", "RANK", at_most=max_ranks - 1),)
    if not chosen:
        msg = "no ranks: the launcher's arguments name none"
        raise ValueError(msg)
    declared = env.get("WORLD_SIZE") or env.get("SLURM_NTASKS")
    world = world_size or (_number(declared, "WORLD_SIZE", at_most=max_ranks) if declared else 0) or max(chosen) + 1
    slurm = {key: value for key, value in env.items() if key.startswith("SLURM_")} if slurm_id else {}
    return RunIdentity(
        job_id=job_id,
        attempt=number,
        node=node_name,
        ranks=chosen,
        world_size=max(world, max(chosen) + 1),
        register=True if register is None else register,
        name=env.get("SLURM_JOB_NAME") or Path(command[0]).name if command else "run",
        kind=kind,
        slurm=slurm,
    )


def registration(identity: RunIdentity, placement: Sequence[RankAssignment]) -> list[Event]:
    """The job's submission and this attempt's placement, as the job's own producer registers them."""
    spec = observed.observed_spec(
        identity.name,
        workers=identity.world_size,
        managed_by="slurm" if identity.slurm else MANAGED_BY,
        tenant=identity.slurm.get("SLURM_JOB_USER", "default"),
        pool=identity.slurm.get("SLURM_JOB_PARTITION", "default"),
    )
    events: list[Event] = []
    if identity.attempt == 1:
        events.append(observed.submitted(identity.job_id, spec, source=identity.source))
    events.append(observed.placed(identity.job_id, identity.attempt, tuple(placement), source=identity.source))
    return events


class RunReport:
    """What the command's output says about its ranks, and the evidence it carries."""

    def __init__(self, identity: RunIdentity) -> None:
        self.identity = identity
        single = identity.ranks[0] if len(identity.ranks) == 1 else None
        # Read as it is written: year-less timestamps are of this year, in UTC (this machine's clock).
        context = SourceContext(
            origin=f"{identity.job_id}/{identity.node}", node=identity.node, rank=single, year=utc_now().year, tz=UTC
        )
        self._parsers = {"stdout": LogParser(context), "stderr": LogParser(context)}
        self._lines = {"stdout": 0, "stderr": 0, "dumps": 0}
        self.exits: dict[int, RankExitedData] = {}
        # Evidence published per rank: each exit carries its rank's count, so telemetry settles no finding
        # before that rank's lines (on another stream, perhaps later) have arrived.
        self.evidence_per_rank: Counter[int] = Counter()
        self._timings: dict[int, TimingBatch] = {}
        """Each rank's step timings not sent yet (the timing hook's lines, `LANES_TORCH_TIMING=1`)."""

    def feed(self, stream: str, line: str, now: float | None = None) -> list[Event]:
        """The events one line of output completes (`now`: a monotonic clock, for batching step timings)."""
        self._lines[stream] += 1
        self._srun_exit(line)
        if (beats := self._step(line, time.monotonic() if now is None else now)) is not None:
            return beats
        return self._evidence(stream, self._parsers[stream].feed(line))

    def finish(self) -> list[Event]:
        """Evidence still held in open multi-line blocks (a traceback at the very end), and the last timings."""
        rests = [(rank, batch.rest()) for rank, batch in sorted(self._timings.items())]
        beats = [self._heartbeat(rank, rest) for rank, rest in rests if rest is not None]
        evidence = [e for stream, parser in self._parsers.items() for e in self._evidence(stream, parser.finish())]
        return beats + evidence

    def _step(self, line: str, now: float) -> list[Event] | None:
        """A step line's heartbeat, once its rank's timings are due ([] until then); None: not a step line.

        The line names its rank (the hook does, under torchrun); a line that does not is the only rank's, when
        this run has one. A step of a rank this run does not hold is plain output.
        """
        try:
            progress = progress_report(line)
        except ValueError:
            return None  # a malformed checkpoint line: plain output
        if not isinstance(progress, HeartbeatData):
            return None
        ranks = self.identity.ranks
        rank = step_rank(line)
        if rank is None and len(ranks) == 1:
            rank = ranks[0]
        if rank is None or rank not in ranks:
            return None
        beat = self._timings.setdefault(rank, TimingBatch(now)).add(progress, now)
        return [] if beat is None else [self._heartbeat(rank, beat)]

    def _heartbeat(self, rank: int, beat: HeartbeatData) -> Event:
        identity = self.identity
        return observed.observed_event(
            Heartbeat,
            job_id=identity.job_id,
            attempt=identity.attempt,
            source=identity.source,
            key=f"{rank}:step:{beat.step}",
            node=observed.token(identity.node),
            rank=rank,
            data=beat,
        )

    def dumps(self, prefix: str, *, remove: bool) -> list[Event]:
        """Each rank's Flight Recorder dump (`<prefix><rank>`), if it wrote one, as that rank's evidence.

        Call it before `rank_exits`: each exit counts its rank's dump too. A dump that cannot be read is said on
        stderr; for the election it is then a missing one.
        """
        found: list[Evidence] = []
        for rank in self.identity.ranks:
            context = SourceContext(
                origin=f"{self.identity.job_id}/rank{rank}", node=self.identity.node, rank=rank, year=None, tz=UTC
            )
            evidence, problem = take_rank_dump(Path(f"{prefix}{rank}"), context, remove=remove)
            if problem is not None:
                print(f"lanes run: {problem}", file=sys.stderr)  # noqa: T201 - the command's stderr is the user's
            found += evidence
        return self._evidence("dumps", found)

    def _srun_exit(self, line: str) -> None:
        if self.identity.kind != "srun" or (found := _SRUN_TASK.search(line)) is None:
            return
        rank = int(found["task"])
        if found["code"] is not None:
            self.exits.setdefault(rank, RankExitedData(exit_code=int(found["code"])))
        else:
            stopped = signal.SIGKILL if found["killed"] else signal.SIGTERM
            self.exits.setdefault(rank, RankExitedData(exit_code=None, signal=stopped))

    def _evidence(self, stream: str, found: list[Evidence]) -> list[Event]:
        identity = self.identity
        events: list[Event] = []
        for evidence in found:
            if evidence.category is EvidenceCategory.RAW:
                continue  # plain output is not evidence
            if evidence.category is EvidenceCategory.PROCESS_EXITED and evidence.rank is not None:
                # torchelastic's failure summary names each failed rank with its exit code or signal.
                data = evidence.data
                exited = RankExitedData(exit_code=data.exit_code, signal=data.signal)
                self.exits.setdefault(evidence.rank, exited)
            if evidence.rank is not None:
                self.evidence_per_rank[evidence.rank] += 1
            event = evidence_event(evidence, source=identity.source, node=identity.node, time=utc_now())
            key = f"{identity.node}:{stream}:{self._lines[stream]}:{len(events)}"
            event = event.model_copy(
                update={
                    "id": derived_event_id(f"{identity.job_id}/{identity.attempt}", event.type, key),
                    "jobid": identity.job_id,
                    "attempt": identity.attempt,
                }
            )
            events.append(event)
        return events

    def rank_exits(self, status: int) -> list[Event]:
        """Every rank's exit: those the output named first (the first failure leads), then the rest.

        Call it after `finish`: each exit counts the evidence its rank's output carried.

        A rank the output did not name exited 0 when the command did. Otherwise srun names every task that
        failed (the others exited 0); torchrun and mpirun stop the rest of the gang (SIGTERM); a single
        rank's status is the command's.
        """
        identity = self.identity
        unnamed: RankExitedData
        if status == 0 or identity.kind == "srun":
            unnamed = RankExitedData(exit_code=0)
        elif len(identity.ranks) == 1:
            unnamed = observed.exit_data(status)
        else:
            unnamed = observed.STOPPED
        ordered = [r for r in self.exits if r in identity.ranks] + [r for r in identity.ranks if r not in self.exits]
        return [
            observed.rank_exited(
                identity.job_id,
                identity.attempt,
                rank,
                identity.node,
                self.exits.get(rank, unnamed).model_copy(update={"evidence": self.evidence_per_rank[rank]}),
                source=identity.source,
            )
            for rank in ordered
        ]


async def _copy(reader: asyncio.StreamReader, sink: BinaryIO, on_line: _LineSink) -> None:
    """Copy output through unchanged, chunk by chunk, and hand each complete line to `on_line`."""
    pending = b""
    while chunk := await reader.read(65536):
        sink.write(chunk)
        sink.flush()
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for line in complete:
            on_line(line.decode("utf-8", "replace"))
    if pending:
        on_line(pending.decode("utf-8", "replace"))


class _LineSink:
    def __init__(self, report: RunReport, stream: str, outbox: Outbox, wake: asyncio.Event) -> None:
        self._report, self._stream, self._outbox, self._wake = report, stream, outbox, wake

    def __call__(self, line: str) -> None:
        events = self._report.feed(self._stream, line)
        if events:
            self._outbox.append(events)
            self._wake.set()


@dataclass
class RunResult:
    """How the command ended, and what is left to publish."""

    status: int
    unsent: int
    outbox: Path
    error: str | None
    set_aside: int = 0
    """Events whose id the stream held for another event: kept in the outbox's conflicts file, not sent."""


class CommandNotStartedError(Exception):
    """The wrapped command could not be started (not found, not executable); nothing of it was reported."""

    def __init__(self, program: str, cause: OSError) -> None:
        super().__init__(f"cannot run {program}: {cause.strerror or cause}")
        self.cause = cause


def exit_status(returncode: int) -> int:
    """The status to exit with: the command's own, or 128+N when signal N killed it (as a shell reports it)."""
    return 128 - returncode if returncode < 0 else returncode


async def run_wrapped(
    command: Sequence[str],
    identity: RunIdentity,
    outbox: Outbox,
    nats_url: str | None,
    *,
    placement: Sequence[RankAssignment] | None = None,
    final_flush_s: float = 10.0,
) -> RunResult:
    """Run the command; report it; return its status once its events are published or safely buffered.

    The ranks' Flight Recorder is on, and dumps where this run collects the dumps: the caller's own place if
    `TORCH_FR_DUMP_TEMP_FILE` names one (the dumps are then left there), else a scratch directory that goes with
    the run.
    """
    with tempfile.TemporaryDirectory(prefix="lanes-run-dumps-") as scratch:
        named = os.environ.get(DUMP_PREFIX)
        dumps = _Dumps(prefix=named or str(Path(scratch) / "rank_"), own=not named)
        return await _run_wrapped(
            command, identity, outbox, nats_url, placement=placement, final_flush_s=final_flush_s, dumps=dumps
        )


@dataclass(frozen=True)
class _Dumps:
    prefix: str
    own: bool
    """Whether the dumps are this run's to remove once read."""


async def _run_wrapped(
    command: Sequence[str],
    identity: RunIdentity,
    outbox: Outbox,
    nats_url: str | None,
    *,
    placement: Sequence[RankAssignment] | None,
    final_flush_s: float,
    dumps: _Dumps,
) -> RunResult:
    sender = Sender(outbox, nats_url, name=f"lanes-run-{identity.node}")
    wake = asyncio.Event()
    started = utc_now()
    proc = await _start(command, identity, outbox, placement, env=RECORDING | os.environ | {DUMP_PREFIX: dumps.prefix})
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread: nothing to forward
            loop.add_signal_handler(signum, proc.send_signal, signum)
    starts: list[Event] = [
        observed.rank_started(
            identity.job_id, identity.attempt, rank, identity.node, source=identity.source, pid=proc.pid, time=started
        )
        for rank in identity.ranks
    ]
    outbox.append(starts)
    report = RunReport(identity)
    stop_sending = asyncio.Event()

    async def keep_sending() -> None:
        backoff = _RETRY_S
        while not stop_sending.is_set():
            wake.clear()
            if not await sender.send():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop_sending.wait(), timeout=backoff)
                backoff = min(backoff * 2, _LONGEST_RETRY_S)  # Lanes is down: retry, less and less often
                continue
            backoff = _RETRY_S
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=_RETRY_S)

    sending = asyncio.create_task(keep_sending())
    assert proc.stdout is not None  # noqa: S101 - started with pipes
    assert proc.stderr is not None  # noqa: S101
    try:
        await asyncio.gather(
            _copy(proc.stdout, sys.stdout.buffer, _LineSink(report, "stdout", outbox, wake)),
            _copy(proc.stderr, sys.stderr.buffer, _LineSink(report, "stderr", outbox, wake)),
        )
        returncode = await proc.wait()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signum)
        stop_sending.set()
        wake.set()  # a sender waiting for new events stops now, not at its next retry
        await sending
    outbox.append(report.finish())
    outbox.append(report.dumps(dumps.prefix, remove=dumps.own))
    outbox.append(report.rank_exits(returncode))
    if identity.register and not identity.slurm:  # under Slurm, the allocation ends with the job: the adapter says so
        outbox.append([observed.released(identity.job_id, identity.attempt, [identity.node], source=identity.source)])
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(sender.send(), timeout=final_flush_s)
    await sender.close()
    unsent = len(outbox.lines())
    return RunResult(exit_status(returncode), unsent, outbox.path, sender.last_error, sender.set_aside)


async def _start(
    command: Sequence[str],
    identity: RunIdentity,
    outbox: Outbox,
    placement: Sequence[RankAssignment] | None,
    *,
    env: Mapping[str, str],
) -> asyncio.subprocess.Process:
    """The command started, its registration in the outbox first.

    Written before the command starts, the registration stops a run whose outbox cannot be written before
    it begins; a command that cannot start takes it back (no sender has run: nothing was sent).
    """
    mark = outbox.size()
    if identity.register:
        chosen = placement or [RankAssignment(rank=r, node=identity.node, gpus=()) for r in identity.ranks]
        outbox.append(registration(identity, chosen))
    try:
        return await asyncio.create_subprocess_exec(
            *command, env=dict(env), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
    except OSError as exc:
        outbox.take_back(mark)
        raise CommandNotStartedError(command[0], exc) from exc


def default_outbox(identity: RunIdentity, env: Mapping[str, str]) -> Path:
    """`$LANES_OUTBOX_DIR` or `~/.cache/lanes/outbox`, one file per job, attempt, node and ranks."""
    cache = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path("~/.cache").expanduser()
    base = Path(env["LANES_OUTBOX_DIR"]) if env.get("LANES_OUTBOX_DIR") else cache / "lanes" / "outbox"
    ranks = f"{identity.ranks[0]}-{identity.ranks[-1]}" if len(identity.ranks) > 1 else str(identity.ranks[0])
    return base / f"{identity.job_id}.{identity.attempt}.{identity.node}.r{ranks}.ndjson"


def slurm_placement(identity: RunIdentity) -> list[RankAssignment] | None:
    """Under Slurm, the job's placement as the Slurm adapter registers it (same nodes, same rank layout).

    `scontrol show hostnames` expands the node list exactly as Slurm does; without it, nothing is guessed.
    """
    nodelist = identity.slurm.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return None
    try:
        shown = subprocess.run(  # noqa: S603 - Slurm's own client, fixed arguments
            ["scontrol", "show", "hostnames", nodelist],  # noqa: S607 - found on PATH as on any Slurm node
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    nodes = shown.stdout.split()
    tasks = int(identity.slurm.get("SLURM_NTASKS") or identity.world_size)
    return list(observed.block_placement(nodes, tasks))
