"""Public GPU cluster traces turned into the log `lanes whatif scheduler` replays: nodes and submissions.

The Alibaba GPU cluster trace of 2023 (`cluster-trace-gpu-v2023`), "openb" format, two CSV files:
- nodes (`openb_node_list_*.csv`): `sn, cpu_milli, memory_mib, gpu, model`; one row per machine;
- pods (`openb_pod_list_*.csv`): `name, cpu_milli, memory_mib, num_gpu, gpu_milli, gpu_spec, qos, pod_phase,
  creation_time, deletion_time, scheduled_time`; times are seconds from the trace's start, `gpu_milli` is the
  share of each GPU a pod asks for (1000 is a whole GPU), `gpu_spec` the GPU models it accepts (`A|B`, or
  empty for any), and `scheduled_time` / `deletion_time` are empty when the pod was never placed / deleted.

Each pod becomes a one-worker job (`num_gpu` GPUs) whose tenant is its `qos` class (so `--policy` can give a
class a priority): submitted at `creation_time`, running from `scheduled_time`, ended at `deletion_time`
(failed if its phase says so, else succeeded; cancelled if it was never placed). Each node becomes a node
registration at the trace's start. The replay keeps each pod's recorded running time.

What the scheduler's model cannot say is counted per kind and never silently dropped: a pod with no GPU or
a fraction of one, more GPUs than one worker may ask for, several acceptable models (imported as any model),
CPU and host memory requests (not scheduled on), a CPU-only node.
"""

from __future__ import annotations

import csv
import io
import json
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from lanes_contract.errors import LanesError
from lanes_contract.events import (
    AttemptRequested,
    AttemptRequestedData,
    Event,
    JobStateChanged,
    JobStateChangedData,
    JobSubmitted,
    JobSubmittedData,
    NodeRegistered,
    NodeRegisteredData,
)
from lanes_contract.ids import derived_event_id, is_valid_token
from lanes_contract.jobs import JobSpec, JobState

SOURCE = "lanes/trace"
ORIGIN = datetime(2023, 1, 1, tzinfo=UTC)
"""The instant a trace's second 0 is placed at (the traces give offsets, not dates)."""
FORMATS = ("openb", "helios", "philly")
POD_COLUMNS = (
    "name",
    "cpu_milli",
    "memory_mib",
    "num_gpu",
    "gpu_milli",
    "gpu_spec",
    "qos",
    "pod_phase",
    "creation_time",
    "deletion_time",
    "scheduled_time",
)
NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
FRACTIONAL = ("skip", "whole")
_MAX_GPUS_PER_WORKER = 16
_MAX_NODE_GPUS = 64
_MAX_SECONDS = 10 * 365 * 86_400


class TraceFormatError(LanesError, ValueError):
    """A trace file that cannot be read; the message names the line."""


@dataclass
class ImportedTrace:
    """The log of a trace (nodes first, then every pod's events in time order) and what it could not say."""

    events: list[Event] = field(default_factory=list)
    nodes: int = 0
    jobs: int = 0
    unexpressed: Counter[str] = field(default_factory=Counter)

    def report(self) -> dict[str, Any]:
        """What was imported and, per kind, what the model cannot express."""
        return {
            "nodes": self.nodes,
            "jobs": self.jobs,
            "events": len(self.events),
            "unexpressed": sum(self.unexpressed.values()),
            "unexpressed_by_kind": dict(sorted(self.unexpressed.items())),
        }


def _rows(text: str, columns: tuple[str, ...], what: str) -> Iterator[tuple[int, Mapping[str, str]]]:
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in columns if c not in (reader.fieldnames or ())]
    if missing:
        raise TraceFormatError(f"line 1: the {what} header lacks {', '.join(missing)} (expected {','.join(columns)})")
    for row in reader:
        if None in row or any(v is None for v in row.values()):
            raise TraceFormatError(f"line {reader.line_num}: expected {len(reader.fieldnames or ())} fields")
        yield reader.line_num, row


def _named_rows(
    text: str, columns: tuple[str, ...], what: str, name_column: str, kind: str
) -> Iterator[tuple[int, Mapping[str, str], str]]:
    """Each row with its name (a token), refusing a name given twice."""
    seen: set[str] = set()
    for line, row in _rows(text, columns, what):
        name = _token(row[name_column], line, name_column)
        if name in seen:
            raise TraceFormatError(f"line {line}: {kind} {name} appears twice")
        seen.add(name)
        yield line, row, name


def _number(row: Mapping[str, str], column: str, line: int, *, empty: bool = False) -> int | None:
    """A non-negative integer field (the traces write some as `12.0`); None when empty is allowed and empty."""
    raw = row[column].strip()
    if not raw:
        if empty:
            return None
        raise TraceFormatError(f"line {line}: {column} is empty; expected a number")
    try:
        value = float(raw)
    except ValueError:
        raise TraceFormatError(f"line {line}: {column} is {raw[:40]!r}; expected a number") from None
    if not 0 <= value <= _MAX_SECONDS * 1000 or value != int(value):
        raise TraceFormatError(f"line {line}: {column} is {raw[:40]!r}; expected a whole number >= 0")
    return int(value)


def _token(value: str, line: int, column: str) -> str:
    value = value.strip()
    if not is_valid_token(value):
        raise TraceFormatError(f"line {line}: {column} {value[:40]!r} is not a name (1-128 of A-Z a-z 0-9 _ -)")
    return value


def _event_id(name: str, event_type: str, key: str = "") -> str:
    """Ids derived from the trace, so importing the same file twice writes the same log."""
    return derived_event_id(f"trace/{name}", event_type, key, at=ORIGIN)


def openb_nodes(text: str, trace: ImportedTrace) -> None:
    """The node list: one registration per machine with GPUs (a CPU-only machine is counted, not imported)."""
    for line, row, node_id in _named_rows(text, NODE_COLUMNS, "openb node list", "sn", "node"):
        gpus = _number(row, "gpu", line) or 0
        if gpus == 0:
            trace.unexpressed["cpu_only_nodes"] += 1
            continue
        if gpus > _MAX_NODE_GPUS:
            raise TraceFormatError(f"line {line}: gpu is {gpus}; a node has at most {_MAX_NODE_GPUS}")
        model = row["model"].strip() or "unknown"
        data = NodeRegisteredData(gpu_model=model, gpus=gpus, gpu_memory_gib=0)
        event_type = NodeRegistered.model_fields["type"].default
        trace.events.append(
            NodeRegistered(id=_event_id(node_id, event_type), source=SOURCE, node=node_id, time=ORIGIN, data=data)
        )
        trace.nodes += 1


def openb_pods(text: str, trace: ImportedTrace, *, fractional: str = "skip") -> None:
    """The pod list: each GPU pod a one-worker job with its submission, start and end."""
    timed: list[tuple[datetime, int, Event]] = []
    for line, row, name in _named_rows(text, POD_COLUMNS, "openb pod list", "name", "pod"):
        gpus = _number(row, "num_gpu", line) or 0
        milli = _number(row, "gpu_milli", line, empty=True)
        created = _number(row, "creation_time", line)
        scheduled = _number(row, "scheduled_time", line, empty=True)
        deleted = _number(row, "deletion_time", line, empty=True)
        if gpus == 0:
            trace.unexpressed["pods_without_gpu"] += 1
            continue
        if milli is not None and milli < 1000:  # noqa: PLR2004 - 1000 milli-GPU is one whole GPU
            trace.unexpressed[f"fractional_gpu_{'rounded_up' if fractional == 'whole' else 'skipped'}"] += 1
            if fractional != "whole":
                continue
        if gpus > _MAX_GPUS_PER_WORKER:
            trace.unexpressed["pods_over_16_gpus"] += 1
            continue
        models = [m for m in row["gpu_spec"].strip().split("|") if m]
        if len(models) > 1:
            trace.unexpressed["several_gpu_models_taken_as_any"] += 1
        if _number(row, "cpu_milli", line) or _number(row, "memory_mib", line):
            trace.unexpressed["cpu_and_memory_requests_ignored"] += 1
        qos = _token(row["qos"] or "none", line, "qos").lower()
        spec = JobSpec(
            name=name, tenant=qos, workers=1, gpus_per_worker=gpus, gpu_model=models[0] if len(models) == 1 else None
        )
        created_at = ORIGIN + timedelta(seconds=created or 0)
        submitted_type = JobSubmitted.model_fields["type"].default
        submitted = JobSubmitted(
            id=_event_id(name, submitted_type),
            source=SOURCE,
            jobid=name,
            attempt=1,
            time=created_at,
            data=JobSubmittedData(spec=spec),
        )
        timed.append((created_at, 0, submitted))
        if scheduled is not None:
            timed.append(
                (ORIGIN + timedelta(seconds=scheduled), 1, _state(name, JobState.RUNNING, scheduled, "scheduled_time"))
            )
        if deleted is not None:
            if scheduled is None:
                end = JobState.CANCELLED
            else:
                end = JobState.FAILED if row["pod_phase"].strip().lower() == "failed" else JobState.SUCCEEDED
            timed.append((ORIGIN + timedelta(seconds=deleted), 2, _state(name, end, deleted, "deletion_time")))
        trace.jobs += 1
    timed.sort(key=lambda item: (item[0], item[1], item[2].jobid or ""))
    trace.events.extend(event for _, _, event in timed)


def _state(name: str, to_state: JobState, seconds: int, column: str) -> JobStateChanged:
    event_type = JobStateChanged.model_fields["type"].default
    data = JobStateChangedData(from_state=None, to_state=to_state, cause_type=f"trace.{column}")
    return JobStateChanged(
        id=_event_id(name, event_type, to_state.value),
        source=SOURCE,
        jobid=name,
        attempt=1,
        time=ORIGIN + timedelta(seconds=seconds),
        data=data,
    )


def import_openb(pods: str, nodes: str | None, *, fractional: str = "skip") -> ImportedTrace:
    """An openb trace (the pod list, and the node list when given) as a log."""
    trace = ImportedTrace()
    if nodes is not None:
        openb_nodes(nodes, trace)
    openb_pods(pods, trace, fractional=fractional)
    return trace


# --- job logs with dates: Helios (SenseTime, SC '21) and Philly (Microsoft, ATC '19) --------------------------

HELIOS_JOB_COLUMNS = (
    "job_id",
    "user",
    "vc",
    "gpu_num",
    "cpu_num",
    "node_num",
    "state",
    "submit_time",
    "start_time",
    "end_time",
    "duration",
    "queue",
)
HELIOS_NODE_GPUS = 8
"""GPUs per Helios node (the SC '21 paper: every node has 8); `cluster_gpu_number.csv` gives GPUs per VC only."""
HELIOS_ENDS = {
    "COMPLETED": JobState.SUCCEEDED,
    "FAILED": JobState.FAILED,
    "TIMEOUT": JobState.FAILED,
    "NODE_FAIL": JobState.FAILED,
    "CANCELLED": JobState.CANCELLED,
}
PHILLY_ENDS = {"Pass": JobState.SUCCEEDED, "Failed": JobState.FAILED, "Killed": JobState.CANCELLED}
PHILLY_MACHINE_COLUMNS = ("machineId", "number of GPUs", "single GPU mem")
_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
_UNRECORDED = ("", "None", "null")
"""How the job logs write a time they did not record (Philly: a logging error, or still running)."""


@dataclass(frozen=True)
class _Run:
    """One recorded attempt: when it started holding GPUs and when (and how) it ended."""

    start: datetime | None
    end: datetime | None
    end_state: JobState


def _date(raw: object, where: str, column: str, *, empty: bool = False) -> datetime | None:
    """A `YYYY-MM-DD HH:MM:SS` time, read as UTC (the logs give no zone); None when unrecorded and allowed."""
    text = "" if raw is None else str(raw).strip()
    if text in _UNRECORDED:
        if empty:
            return None
        raise TraceFormatError(f"{where}: {column} is empty; expected a time like 2020-06-09 18:41:01")
    try:
        return datetime.strptime(text, _DATE_FORMAT).replace(tzinfo=UTC)
    except ValueError:
        raise TraceFormatError(
            f"{where}: {column} is {text[:40]!r}; expected a time like 2020-06-09 18:41:01"
        ) from None


def _job_events(
    name: str, spec: JobSpec, submitted_at: datetime, runs: list[_Run]
) -> list[tuple[datetime, int, Event]]:
    """A job's submission, then per attempt its request (after the first), its start and its end."""
    submitted_type = JobSubmitted.model_fields["type"].default
    out: list[tuple[datetime, int, Event]] = [
        (
            submitted_at,
            0,
            JobSubmitted(
                id=_event_id(name, submitted_type),
                source=SOURCE,
                jobid=name,
                attempt=1,
                time=submitted_at,
                data=JobSubmittedData(spec=spec),
            ),
        )
    ]
    requested_type = AttemptRequested.model_fields["type"].default
    previous_end: datetime | None = None
    for number, run in enumerate(runs, start=1):
        if number > 1 and previous_end is not None:
            # The logs record no request time: the retry is asked for when the attempt before it ended.
            data = AttemptRequestedData(reason="trace: the job's next recorded attempt")
            request = AttemptRequested(
                id=_event_id(name, requested_type, str(number)),
                source=SOURCE,
                jobid=name,
                attempt=number,
                time=previous_end,
                data=data,
            )
            out.append((previous_end, 3, request))  # after the end it follows, at the same instant
        if run.start is not None:
            out.append((run.start, 1, _dated_state(name, number, JobState.RUNNING, run.start)))
        if run.end is not None:
            out.append((run.end, 2, _dated_state(name, number, run.end_state, run.end)))
        previous_end = run.end
    return out


def _dated_state(name: str, attempt: int, to_state: JobState, at: datetime) -> JobStateChanged:
    event_type = JobStateChanged.model_fields["type"].default
    data = JobStateChangedData(from_state=None, to_state=to_state, cause_type="trace")
    return JobStateChanged(
        id=_event_id(name, event_type, f"{attempt}/{to_state.value}"),
        source=SOURCE,
        jobid=name,
        attempt=attempt,
        time=at,
        data=data,
    )


def _register(trace: ImportedTrace, node_id: str, gpus: int, *, memory_gib: int = 0, pool: str = "default") -> None:
    data = NodeRegisteredData(gpu_model="unknown", gpus=gpus, gpu_memory_gib=memory_gib, pool=pool)
    event_type = NodeRegistered.model_fields["type"].default
    trace.events.append(
        NodeRegistered(id=_event_id(node_id, event_type), source=SOURCE, node=node_id, time=ORIGIN, data=data)
    )
    trace.nodes += 1


def _finish(trace: ImportedTrace, timed: list[tuple[datetime, int, Event]]) -> None:
    """Jobs in time order, after the nodes; the nodes are registered at the first job's time."""
    timed.sort(key=lambda item: (item[0], item[1], item[2].jobid or "", item[2].attempt or 0))
    if timed:
        start = timed[0][0]
        trace.events[:] = [e.model_copy(update={"time": start}) for e in trace.events]
    trace.events.extend(event for _, _, event in timed)


def helios_nodes(text: str, trace: ImportedTrace) -> set[str]:
    """`cluster_gpu_number.csv`: each VC a pool of 8-GPU nodes, sized by the most GPUs it had on any day."""
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if not header or header[0].strip() != "date" or header[-1].strip() != "total":
        raise TraceFormatError("line 1: expected the header date,<vc>...,total of cluster_gpu_number.csv")
    vcs = [_token(name, 1, "vc") for name in header[1:-1]]
    most: dict[str, int] = dict.fromkeys(vcs, 0)
    sizes: dict[str, set[int]] = {vc: set() for vc in vcs}
    for row in reader:
        line = reader.line_num
        if not row:
            continue
        if len(row) != len(header):
            raise TraceFormatError(f"line {line}: expected {len(header)} fields")
        _date(f"{row[0].strip()} 00:00:00", f"line {line}", "date")
        for vc, raw in zip(vcs, row[1:-1], strict=True):
            gpus = _number({vc: raw}, vc, line) or 0
            most[vc] = max(most[vc], gpus)
            sizes[vc].add(gpus)
    pools = set()
    for vc in vcs:
        if len(sizes[vc]) > 1:
            trace.unexpressed["vc_size_changes_over_days_taken_at_their_largest"] += 1
        whole, rest = divmod(most[vc], HELIOS_NODE_GPUS)
        for index in range(whole):
            _register(trace, f"{vc}-{index + 1:03d}", HELIOS_NODE_GPUS, pool=vc)
        if rest:
            trace.unexpressed["vc_gpus_not_a_multiple_of_8_as_a_smaller_node"] += 1
            _register(trace, f"{vc}-{whole + 1:03d}", rest, pool=vc)
        if most[vc]:
            pools.add(vc)
    return pools


def helios_jobs(text: str, trace: ImportedTrace, pools: set[str] | None = None) -> None:
    """`cluster_log.csv`: each GPU job a gang of `node_num` workers in its VC's pool, at its recorded times."""
    timed: list[tuple[datetime, int, Event]] = []
    for line, row, job_id in _named_rows(text, HELIOS_JOB_COLUMNS, "Helios cluster_log", "job_id", "job"):
        where = f"line {line}"
        gpus = _number(row, "gpu_num", line) or 0
        nodes = max(_number(row, "node_num", line) or 1, 1)
        state = row["state"].strip().upper()
        submitted = _date(row["submit_time"], where, "submit_time")
        start = _date(row["start_time"], where, "start_time", empty=True)
        end = _date(row["end_time"], where, "end_time", empty=True)
        assert submitted is not None  # noqa: S101 - not allowed empty above
        if gpus == 0:
            trace.unexpressed["jobs_without_gpu"] += 1
            continue
        if state not in HELIOS_ENDS:
            trace.unexpressed[f"jobs_in_state_{state.lower() or 'empty'}_skipped"] += 1
            continue
        per_worker = -(-gpus // nodes)
        if per_worker * nodes != gpus:
            trace.unexpressed["gpus_uneven_across_nodes_rounded_up"] += 1
        if per_worker > _MAX_GPUS_PER_WORKER:
            trace.unexpressed["workers_over_16_gpus"] += 1
            continue
        if _number(row, "cpu_num", line):
            trace.unexpressed["cpu_requests_ignored"] += 1
        vc = _token(row["vc"] or "none", line, "vc")
        pool = "default"
        if pools is None:
            trace.unexpressed["vc_partitions_not_imported_without_nodes"] += 1
        elif vc in pools:
            pool = vc
        else:
            trace.unexpressed["jobs_of_a_vc_without_gpus_in_the_default_pool"] += 1
        name = f"helios-{job_id}"
        spec = JobSpec(name=name, tenant=vc, pool=pool, workers=nodes, gpus_per_worker=per_worker)
        ended = HELIOS_ENDS[state]
        if start is None and ended is not JobState.CANCELLED:
            trace.unexpressed["ended_without_starting_as_cancelled"] += 1
        runs = [_Run(start, end, ended if start is not None else JobState.CANCELLED)]
        timed.extend(_job_events(name, spec, submitted, runs))
        trace.jobs += 1
    _finish(trace, timed)


def philly_machines(text: str, trace: ImportedTrace) -> None:
    """`cluster_machine_list`: `machineId,number of GPUs,single GPU mem` (e.g. `m31,8, 24GB`), one node each."""
    reader = csv.reader(io.StringIO(text))
    header = [name.strip() for name in next(reader, [])]
    if tuple(header) != PHILLY_MACHINE_COLUMNS:
        raise TraceFormatError(f"line 1: expected the header {','.join(PHILLY_MACHINE_COLUMNS)}")
    seen: set[str] = set()
    for row in reader:
        line = reader.line_num
        if not row:
            continue
        if len(row) != len(header):
            raise TraceFormatError(f"line {line}: expected {len(header)} fields")
        node_id = _token(row[0], line, "machineId")
        if node_id in seen:
            raise TraceFormatError(f"line {line}: machine {node_id} appears twice")
        seen.add(node_id)
        gpus = _number({"number of GPUs": row[1]}, "number of GPUs", line) or 0
        if gpus > _MAX_NODE_GPUS:
            raise TraceFormatError(f"line {line}: number of GPUs is {gpus}; a node has at most {_MAX_NODE_GPUS}")
        if gpus == 0:
            trace.unexpressed["cpu_only_nodes"] += 1
            continue
        memory = row[2].strip().upper().removesuffix("GB").strip()
        if not memory.isdigit():
            raise TraceFormatError(f"line {line}: single GPU mem is {row[2].strip()[:20]!r}; expected e.g. 24GB")
        _register(trace, node_id, gpus, memory_gib=int(memory))


def _philly_shape(attempt: Mapping[str, Any], where: str, trace: ImportedTrace) -> tuple[int, int] | None:
    """(workers, GPUs per worker) of one attempt: one worker per machine it ran on."""
    detail = attempt.get("detail")
    if not isinstance(detail, list) or not detail:
        return None
    counts = []
    for machine in detail:
        gpus = machine.get("gpus") if isinstance(machine, dict) else None
        if not isinstance(gpus, list):
            raise TraceFormatError(f"{where}: every attempt detail needs a list of gpus")
        counts.append(len(gpus))
    if len(set(counts)) > 1:
        trace.unexpressed["uneven_gpus_across_machines_rounded_up"] += 1
    return len(counts), max(counts)


def philly_jobs(text: str, trace: ImportedTrace) -> None:
    """`cluster_job_log` (JSON): each job with its attempts, each attempt a new attempt of the same job."""
    try:
        jobs = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"line {exc.lineno}: not JSON: {exc.msg}") from None
    if not isinstance(jobs, list):
        raise TraceFormatError("line 1: expected a JSON list of jobs")
    timed: list[tuple[datetime, int, Event]] = []
    seen: set[str] = set()
    for index, job in enumerate(jobs, start=1):
        timed.extend(_philly_job(index, job, seen, trace))
    _finish(trace, timed)


def _philly_job(index: int, job: object, seen: set[str], trace: ImportedTrace) -> list[tuple[datetime, int, Event]]:
    """One job's events, or none when what it records cannot be replayed (counted)."""
    if not isinstance(job, dict):
        raise TraceFormatError(f"job {index}: expected an object")
    missing = [key for key in ("status", "vc", "jobid", "attempts", "submitted_time") if key not in job]
    if missing:
        raise TraceFormatError(f"job {index}: lacks {', '.join(missing)}")
    job_id = _token(str(job["jobid"]), index, "jobid").removeprefix("application_")
    where = f"job {index} ({job['jobid']})"
    if job_id in seen:
        raise TraceFormatError(f"{where}: appears twice")
    seen.add(job_id)
    status = str(job["status"])
    if status not in PHILLY_ENDS:
        raise TraceFormatError(f"{where}: status is {status[:20]!r}; expected Pass, Killed or Failed")
    submitted = _date(job["submitted_time"], where, "submitted_time")
    assert submitted is not None  # noqa: S101 - not allowed empty above
    attempts = job["attempts"]
    if not isinstance(attempts, list):
        raise TraceFormatError(f"{where}: attempts is not a list")
    if not attempts:
        trace.unexpressed["jobs_never_scheduled_skipped"] += 1
        return []
    runs, shape = _philly_runs(attempts, PHILLY_ENDS[status], where, trace)
    if not runs or shape is None:
        trace.unexpressed["jobs_without_a_usable_attempt_skipped"] += 1
        return []
    workers, per_worker = shape
    if per_worker == 0:
        trace.unexpressed["jobs_without_gpu"] += 1
        return []
    if per_worker > _MAX_GPUS_PER_WORKER:
        trace.unexpressed["workers_over_16_gpus"] += 1
        return []
    name = f"philly-{job_id}"
    vc = _token(str(job["vc"]) or "none", index, "vc")
    spec = JobSpec(name=name, tenant=vc, workers=workers, gpus_per_worker=per_worker)
    trace.jobs += 1
    return _job_events(name, spec, submitted, runs)


def _philly_runs(
    attempts: list[Any], final: JobState, where: str, trace: ImportedTrace
) -> tuple[list[_Run], tuple[int, int] | None]:
    """The attempts with their times (the last ends as the job did, the others failed), and the job's shape."""
    runs: list[_Run] = []
    shape: tuple[int, int] | None = None
    for position, attempt in enumerate(attempts, start=1):
        if not isinstance(attempt, dict):
            raise TraceFormatError(f"{where}: attempt {position} is not an object")
        start = _date(attempt.get("start_time"), where, "start_time", empty=True)
        end = _date(attempt.get("end_time"), where, "end_time", empty=True)
        last = position == len(attempts)
        if start is None or (end is None and not last):
            trace.unexpressed["attempts_without_times_skipped"] += 1
            continue
        if end is None:
            trace.unexpressed["jobs_still_running_at_the_snapshot"] += 1
        this_shape = _philly_shape(attempt, where, trace)
        if shape is None:
            shape = this_shape
        elif this_shape is not None and this_shape != shape:
            trace.unexpressed["attempt_shapes_differ_taken_from_the_first"] += 1
        runs.append(_Run(start, end, final if last else JobState.FAILED))
    return runs, shape
