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
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from lanes_contract.errors import LanesError
from lanes_contract.events import (
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
FORMATS = ("openb",)
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
