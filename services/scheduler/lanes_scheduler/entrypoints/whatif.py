"""What-if by replay: the scheduler's real handlers run over a recorded log against a changed cluster.

The replay feeds what the scheduler's two consumers read (node registrations, node states, the cluster policy;
submissions, new attempts and the ends of attempts) to the same `Scheduler` handlers the service runs, on the
in-memory repository (`adapters/memory.py`), in time order. Events recorded at the same instant are applied
as one batch and the queue is decided once after them, as the live consumer decides once per fetched batch
(an imported trace registers its whole cluster at one instant).

Run twice, the replay gives the old and the new schedule: first with the log's own inventory, policy and
priorities, then with the changes (`Changes`: another node list, other pools and quotas, other priorities).

Time moves with the placements. An attempt the log shows holding GPUs (placed, or running, before it ended)
keeps the time it held them, counted from the input that let it be placed (the replay places at that input's
time): it ends that long after the replay places it, so a job that now waits longer also finishes later.
An attempt that ended without ever being placed (cancelled while it waited) ends at its recorded time. A
retry (attempt n+1) is requested as long after attempt n ended as it was in the log. With no change every
end falls at its recorded time, so the replay of the log's own cluster is the recorded past.

The replay check: where the log holds the scheduler's own decisions (`job_placed`, `job_waiting`,
`job_rejected`), the old replay must reproduce each of them (the same GPUs, the same wait reasons in the same
order). `replay_check` says how many it did and lists any it did not.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from lanes_contract.events import (
    AttemptRequested,
    ClusterPolicySet,
    ClusterPolicySetData,
    Event,
    JobPlaced,
    JobRejected,
    JobStateChanged,
    JobSubmitted,
    JobWaiting,
    NodeRegistered,
    NodeRegisteredData,
    NodeStateChanged,
    NodeStateChangedData,
    ResourcesReleased,
)
from lanes_contract.jobs import JobState
from lanes_contract.topology import ClusterPolicy, Node, NodeState
from lanes_scheduler.adapters.memory import MemoryBatch, MemoryScheduling, MemoryUnitOfWork
from lanes_scheduler.service_layer.handlers import SOURCE, TERMINAL, Scheduler

Ref = tuple[str, int]
"""(job id, attempt)."""
_NODE_INPUTS = (NodeRegistered, NodeStateChanged, ClusterPolicySet)
_SOURCE_WHATIF = "lanes/whatif"
TIME_TREATMENT = (
    "an attempt that held GPUs keeps its recorded holding time from its new placement; one that ended without "
    "being placed ends at its recorded time; a retry follows its previous attempt's end by the recorded gap"
)
WAIT_TREATMENT = "a job still waiting when the replay ends counts its wait up to that end"


class PriorityChanges(BaseModel):
    """`--policy FILE`: priorities to try, per tenant and per job (a job's id or its spec's name wins)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tenants: dict[str, int] = Field(default_factory=dict, description="Priority of every job of a tenant.")
    jobs: dict[str, int] = Field(default_factory=dict, description="Priority of one job, by id or spec name.")

    def priority(self, job_id: str, name: str, tenant: str, recorded: int) -> int:
        """The priority a submission gets under these changes."""
        for key in (job_id, name):
            if key in self.jobs:
                return self.jobs[key]
        return self.tenants.get(tenant, recorded)


@dataclass(frozen=True)
class Changes:
    """What the new run changes: the nodes, the pools and quotas, the priorities (None: as recorded)."""

    nodes: tuple[Node, ...] | None = None
    policy: ClusterPolicy | None = None
    priorities: PriorityChanges | None = None


@dataclass
class AttemptRun:
    """One attempt in one run: when it was queued, placed and ended, where, and why it waited."""

    job_id: str
    attempt: int
    queued_at: datetime
    placed_at: datetime | None = None
    ended_at: datetime | None = None
    assignments: tuple[tuple[str, tuple[int, ...]], ...] = ()
    reasons: list[str] = field(default_factory=list)
    rejected: str | None = None

    @property
    def gpus(self) -> int:
        """GPUs the attempt held."""
        return sum(len(gpus) for _, gpus in self.assignments)

    def wait_s(self, end: datetime) -> float:
        """Seconds from queued to placed (or to `end` when never placed)."""
        return ((self.placed_at or end) - self.queued_at).total_seconds()

    def placement(self) -> list[dict[str, Any]]:
        """`[{"node", "gpus"}]` in rank order."""
        return [{"node": node, "gpus": list(gpus)} for node, gpus in self.assignments]


@dataclass
class Run:
    """One replay's outcome: every attempt, and what the independent GPU ledger saw."""

    attempts: dict[Ref, AttemptRun]
    start: datetime | None
    end: datetime | None
    total_gpus: int
    double_booked: int
    fragmentation_gpu_s: float
    """Integral over time of free GPUs that no waiting gang could use, in GPU-seconds."""
    unexpressed: Counter[str]


@dataclass(frozen=True)
class _Recorded:
    """What the log shows of one attempt: queued, holding since, ended, and the scheduler's decisions."""

    queued: Event | None = None
    holding_since: datetime | None = None
    end: JobStateChanged | None = None
    end_seq: int = 0
    placement: tuple[tuple[str, tuple[int, ...]], ...] | None = None
    reasons: tuple[str, ...] = ()
    rejected: str | None = None


def _assignments(placed: JobPlaced) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((a.node, tuple(a.gpus)) for a in placed.data.assignments)


def _read_log(events: Sequence[Event]) -> dict[Ref, _Recorded]:
    """Per attempt: its queuing event, since when it held GPUs, its first end, and the scheduler's decisions."""
    found: dict[Ref, dict[str, Any]] = {}
    times = {event.id: event.time for event in events}
    for seq, event in enumerate(events, start=1):
        if event.jobid is None:
            continue
        rec = found.setdefault((event.job_key, event.attempt or 1), {"reasons": []})
        if isinstance(event, JobSubmitted | AttemptRequested):
            rec.setdefault("queued", event)
        elif isinstance(event, JobPlaced) and event.source == SOURCE and "placement" not in rec:
            rec["placement"] = _assignments(event)
            # Held from the moment of the input that let it be placed, not from when the placement was
            # published: the replay places at that input's time, so the recorded processing delay would
            # otherwise shorten every holding and end each attempt early.
            rec.setdefault("holding_since", times.get(event.causationid or "", event.time))
        elif isinstance(event, JobWaiting) and event.source == SOURCE and "placement" not in rec:
            rec["reasons"].append(event.data.reason)
        elif isinstance(event, JobRejected) and event.source == SOURCE:
            rec.setdefault("rejected", event.data.reason)
        elif isinstance(event, JobStateChanged):
            if event.data.to_state is JobState.RUNNING:
                rec.setdefault("holding_since", event.time)
            elif event.data.to_state in TERMINAL and "end" not in rec:
                rec["end"], rec["end_seq"] = event, seq
    return {
        ref: _Recorded(
            queued=rec.get("queued"),
            holding_since=rec.get("holding_since"),
            end=rec.get("end"),
            end_seq=rec.get("end_seq", 0),
            placement=rec.get("placement"),
            reasons=tuple(rec["reasons"]),
            rejected=rec.get("rejected"),
        )
        for ref, rec in found.items()
    }


class _Replay:
    """One run of the scheduler's handlers over the log's inputs, with time moving as the placements do."""

    def __init__(self, events: Sequence[Event], recorded: Mapping[Ref, _Recorded], changes: Changes | None) -> None:
        self.recorded = recorded
        self.changes = changes or Changes()
        self.repo = MemoryScheduling()
        self.scheduler = Scheduler()
        self.heap: list[tuple[datetime, int, int, Event]] = []
        self._pushed = 0
        self.attempts: dict[Ref, AttemptRun] = {}
        self.unexpressed: Counter[str] = Counter()
        self.ledger: dict[tuple[str, int], Ref] = {}
        self.free: dict[str, int] = {}
        """Free GPUs per node with any free (kept as placements and releases happen, reread on inventory changes)."""
        self._inventory: dict[str, Node] = {}
        self.double_booked = 0
        self.fragmentation_gpu_s = 0.0
        self._follow_ups: dict[Ref, tuple[Event, timedelta, int]] = {}
        self.start: datetime | None = None
        self.end: datetime | None = None
        self._plan(events)

    def _push(self, at: datetime, seq: int, event: Event) -> None:
        self._pushed += 1
        heapq.heappush(self.heap, (at, seq, self._pushed, event))

    def _plan(self, events: Sequence[Event]) -> None:
        """Put every input the run starts with on the clock; ends and retries follow from placements."""
        if not events:
            return
        t0 = min(e.time for e in events)
        injected = self._injected(t0)
        for seq, event in enumerate(injected, start=1):
            self._push(t0, seq, event)
        offset = len(injected)
        changes = self.changes
        for seq, event in enumerate(events, start=offset + 1):
            if isinstance(event, NodeRegistered) and changes.nodes is not None:
                continue  # the changed inventory replaces the recorded one
            if isinstance(event, ClusterPolicySet) and changes.policy is not None:
                continue
            if isinstance(event, _NODE_INPUTS):
                self._push(event.time, seq, event)
            elif isinstance(event, JobSubmitted):
                self._plan_submission(event, seq)
            elif isinstance(event, AttemptRequested):
                self._plan_attempt(event, seq)
            elif isinstance(event, JobStateChanged) and event.data.to_state in TERMINAL:
                rec = self.recorded.get((event.job_key, event.attempt or 1))
                if rec is None or rec.end is not event:
                    continue  # a second end of the same attempt: the first one released it
                if rec.queued is None:
                    # Submitted before the log begins: the replay never queued it, so it has nothing to end.
                    self.unexpressed["attempts_queued_before_the_log"] += 1
                elif rec.holding_since is None:
                    self._push(event.time, seq, event)  # ended before it was ever placed: the owner's act
                # an end after holding GPUs is put on the clock when the replay places the attempt

    def _injected(self, t0: datetime) -> list[Event]:
        """The changed inventory (with each node's state) and policy, given at the start of the log."""
        out: list[Event] = []
        if self.changes.nodes is not None:
            for node in self.changes.nodes:
                fields = NodeRegisteredData(**node.model_dump(include=set(NodeRegisteredData.model_fields)))
                out.append(NodeRegistered(source=_SOURCE_WHATIF, node=node.node_id, time=t0, data=fields))
                if node.status.state is not NodeState.READY:
                    data = NodeStateChangedData(state=node.status.state, reason=node.status.reason)
                    out.append(NodeStateChanged(source=_SOURCE_WHATIF, node=node.node_id, time=t0, data=data))
        if self.changes.policy is not None:
            data_policy = ClusterPolicySetData(policy=self.changes.policy)
            out.append(ClusterPolicySet(source=_SOURCE_WHATIF, time=t0, data=data_policy))
        return out

    def _plan_submission(self, event: JobSubmitted, seq: int) -> None:
        spec = event.data.spec
        if spec.managed_by is not None:
            self.unexpressed["observed_jobs"] += 1  # another system placed it: nothing to replay
            return
        if self.changes.priorities is not None:
            priority = self.changes.priorities.priority(event.job_key, spec.name, spec.tenant, spec.priority)
            if priority != spec.priority:
                data = event.data.model_copy(update={"spec": spec.model_copy(update={"priority": priority})})
                event = event.model_copy(update={"data": data})
        self._push(event.time, seq, event)

    def _plan_attempt(self, event: AttemptRequested, seq: int) -> None:
        """A retry follows the end of the attempt before it by the recorded gap (or comes at its time)."""
        attempt = event.attempt or 1
        before = self.recorded.get((event.job_key, attempt - 1))
        if before is not None and before.end is not None and before.holding_since is not None:
            gap = max(event.time - before.end.time, timedelta(0))
            self._follow_ups[event.job_key, attempt - 1] = (event, gap, seq)
        else:
            self._push(event.time, seq, event)

    async def run(self) -> Run:
        """Apply the inputs in time order, a batch per instant; watch what the handlers publish."""
        while self.heap:
            now = self.heap[0][0]
            if self.end is not None:
                self.fragmentation_gpu_s += self._fragmentation() * (now - self.end).total_seconds()
            self.start = self.start or now
            self.end = now
            batch = MemoryBatch()
            published: list[Event] = []
            inventory_changed = False
            while self.heap and self.heap[0][0] == now:
                _, seq, _, event = heapq.heappop(self.heap)
                inventory_changed |= isinstance(event, _NODE_INPUTS)
                self._queued(event, now)
                uow = MemoryUnitOfWork(self.repo, seq, batch)
                if isinstance(event, _NODE_INPUTS):
                    published.extend(await self.scheduler.apply_node_event(event, uow))
                else:
                    published.extend(await self.scheduler.apply_job_event(event, uow))
            published.extend(output for _, output in await batch.commit())
            if inventory_changed:
                await self._reread_inventory()
            for output in published:
                self._observe(output, now)
        total = sum(n.gpus for n in await self.repo.nodes())
        refused = self.repo.releases_refused
        for outcome, count in refused.items():
            self.unexpressed[f"releases_{outcome}"] += count
        return Run(
            self.attempts,
            self.start,
            self.end,
            total,
            self.double_booked,
            self.fragmentation_gpu_s,
            self.unexpressed,
        )

    def _queued(self, event: Event, now: datetime) -> None:
        if isinstance(event, JobSubmitted | AttemptRequested):
            ref = (event.job_key, event.attempt or 1)
            self.attempts.setdefault(ref, AttemptRun(ref[0], ref[1], now))
        elif isinstance(event, JobStateChanged):
            run = self.attempts.get((event.job_key, event.attempt or 1))
            if run is not None and run.ended_at is None:
                run.ended_at = now

    def _observe(self, output: Event, now: datetime) -> None:
        """Follow the run's decisions: placements (checked against the GPU ledger), waits, rejections, releases."""
        ref = (output.job_key, output.attempt or 1)
        run = self.attempts.get(ref)
        if run is None:
            return
        if isinstance(output, JobPlaced):
            run.placed_at = now
            run.assignments = _assignments(output)
            for node, gpus in run.assignments:
                for gpu in gpus:
                    if (node, gpu) in self.ledger:
                        self.double_booked += 1
                    self.ledger[node, gpu] = ref
                self._take(node, len(gpus))
            self._plan_end(ref, now)
        elif isinstance(output, JobWaiting):
            run.reasons.append(output.data.reason)
        elif isinstance(output, JobRejected):
            run.rejected = output.data.reason
        elif isinstance(output, ResourcesReleased):
            for node, gpus in run.assignments:
                for gpu in gpus:
                    if self.ledger.get((node, gpu)) == ref:
                        del self.ledger[node, gpu]
                self._take(node, -len(gpus))

    def _plan_end(self, ref: Ref, placed_at: datetime) -> None:
        """The attempt ends as long after this placement as it held GPUs in the log; its retry follows."""
        rec = self.recorded.get(ref)
        if rec is None or rec.end is None or rec.holding_since is None:
            return
        ends_at = placed_at + max(rec.end.time - rec.holding_since, timedelta(0))
        self._push(ends_at, rec.end_seq, rec.end.model_copy(update={"time": ends_at}))
        follow = self._follow_ups.pop(ref, None)
        if follow is not None:
            retry, gap, seq = follow
            self._push(ends_at + gap, seq, retry.model_copy(update={"time": ends_at + gap}))

    async def _reread_inventory(self) -> None:
        """The nodes as the repository now holds them, and each one's free GPUs by the ledger."""
        held: Counter[str] = Counter(node for node, _ in self.ledger)
        self._inventory = {n.node_id: n for n in await self.repo.nodes()}
        self.free = {n: node.gpus - held[n] for n, node in self._inventory.items() if node.gpus > held[n]}

    def _take(self, node_id: str, gpus: int) -> None:
        node = self._inventory.get(node_id)
        if node is None:
            return
        left = self.free.get(node_id, 0) - gpus
        if left > 0:
            self.free[node_id] = left
        else:
            self.free.pop(node_id, None)

    def _fragmentation(self) -> int:
        """Free GPUs on nodes where no waiting gang can place one worker (0 when nothing waits)."""
        shapes = self.repo.waiting_shapes()
        if not shapes:
            return 0
        unusable = 0
        for node_id, free in self.free.items():
            node = self._inventory[node_id]
            usable = node.status.state is NodeState.READY and any(
                pool == node.pool
                and per <= free
                and (model is None or model == node.gpu_model)
                and (memory is None or node.gpu_memory_gib >= memory)
                and node.node_id not in avoid
                for pool, per, model, memory, avoid in shapes
            )
            unusable += 0 if usable else free
        return unusable


@dataclass(frozen=True)
class SchedulerWhatIf:
    """The old and new schedules of one log, their deltas, the per-job diff and the replay check."""

    old: Run
    new: Run
    recorded: Mapping[Ref, _Recorded]
    events: int

    @property
    def span(self) -> tuple[datetime | None, datetime | None]:
        """From the first input to the last moment either run reached: the window both are measured over."""
        starts = [r.start for r in (self.old, self.new) if r.start is not None]
        ends = [r.end for r in (self.old, self.new) if r.end is not None]
        return (min(starts) if starts else None, max(ends) if ends else None)

    def _metrics(self, run: Run) -> dict[str, Any]:
        start, end = self.span
        if start is None or end is None:
            start = end = datetime.min.replace(tzinfo=UTC)  # an empty log: no attempt, nothing measured
        seconds = (end - start).total_seconds()
        waits = sorted(a.wait_s(end) for a in run.attempts.values() if a.rejected is None)
        held = sum(
            a.gpus * ((a.ended_at or end) - a.placed_at).total_seconds()
            for a in run.attempts.values()
            if a.placed_at is not None
        )
        capacity = run.total_gpus * seconds
        return {
            "placed": sum(a.placed_at is not None for a in run.attempts.values()),
            "utilisation": round(held / capacity, 6) if capacity else 0.0,
            "queue_wait_p50_s": _percentile(waits, 50),
            "queue_wait_p99_s": _percentile(waits, 99),
            "fragmentation": round(run.fragmentation_gpu_s / seconds, 6) if seconds else 0.0,
            "double_booked": run.double_booked,
            "wait_reasons": dict(sorted(Counter(r for a in run.attempts.values() for r in a.reasons).items())),
        }

    def diff(self) -> list[dict[str, Any]]:
        """Each attempt whose placement, wait or reasons differ between the old and new run."""
        _, end = self.span
        changes = []
        for ref in sorted(set(self.old.attempts) | set(self.new.attempts)):
            sides = [self._side(run.attempts.get(ref), end) for run in (self.old, self.new)]
            if sides[0] != sides[1]:
                changes.append({"job_id": ref[0], "attempt": ref[1], "old": sides[0], "new": sides[1]})
        return changes

    @staticmethod
    def _side(run: AttemptRun | None, end: datetime | None) -> dict[str, Any] | None:
        if run is None or end is None:
            return None
        return {
            "placement": run.placement(),
            "placed_at": None if run.placed_at is None else run.placed_at.isoformat(),
            "wait_s": round(run.wait_s(end), 6),
            "reasons": list(run.reasons),
            "rejected": run.rejected,
        }

    def replay_check(self) -> dict[str, Any]:
        """The old run against the scheduler decisions the log records: each must come out the same."""
        recorded = 0
        differences = []
        for ref, rec in sorted(self.recorded.items()):
            if rec.placement is None and not rec.reasons and rec.rejected is None:
                continue
            recorded += 1
            run = self.old.attempts.get(ref)
            replayed = (
                (run.assignments or None, tuple(run.reasons), run.rejected) if run is not None else (None, (), None)
            )
            if replayed != (rec.placement, rec.reasons, rec.rejected):
                differences.append(
                    {
                        "job_id": ref[0],
                        "attempt": ref[1],
                        "recorded": _decision(rec.placement, rec.reasons, rec.rejected),
                        "replayed": _decision(*replayed),
                    }
                )
        return {"recorded": recorded, "reproduced": recorded - len(differences), "differences": differences}

    def as_json(self) -> dict[str, Any]:
        """`lanes whatif scheduler --json`."""
        old, new = self._metrics(self.old), self._metrics(self.new)

        def compared(name: str) -> dict[str, Any]:
            before, after = old[name], new[name]
            return {"old": before, "new": after, "delta": round(after - before, 6)}

        start, end = self.span
        return {
            "jobs": len(set(self.old.attempts) | set(self.new.attempts)),
            "placed": compared("placed"),
            "unexpressed": sum(self.old.unexpressed.values()),
            "unexpressed_by_kind": dict(sorted(self.old.unexpressed.items())),
            "double_booked": {"old": old["double_booked"], "new": new["double_booked"]},
            "utilisation": compared("utilisation"),
            "queue_wait_p50_s": compared("queue_wait_p50_s"),
            "queue_wait_p99_s": compared("queue_wait_p99_s"),
            "fragmentation": compared("fragmentation"),
            "wait_reasons": {"old": old["wait_reasons"], "new": new["wait_reasons"]},
            "diff": self.diff(),
            "replay_check": self.replay_check(),
            "replay": {
                "events": self.events,
                "from": None if start is None else start.isoformat(),
                "until": None if end is None else end.isoformat(),
                "gpus": {"old": self.old.total_gpus, "new": self.new.total_gpus},
                "time": TIME_TREATMENT,
                "waits": WAIT_TREATMENT,
            },
        }


def _decision(
    placement: Iterable[tuple[str, Iterable[int]]] | None, reasons: Iterable[str], rejected: str | None
) -> dict[str, Any]:
    return {
        "placement": None if placement is None else [{"node": n, "gpus": list(g)} for n, g in placement],
        "reasons": list(reasons),
        "rejected": rejected,
    }


def _percentile(values: Sequence[float], pct: int) -> float:
    """The nearest-rank percentile (0.0 for no values)."""
    if not values:
        return 0.0
    rank = max(1, -(-pct * len(values) // 100))
    return round(values[rank - 1], 6)


async def replay_scheduler(events: Sequence[Event], changes: Changes | None = None) -> SchedulerWhatIf:
    """Replay the log's scheduler inputs as recorded and under `changes`; compare the two schedules."""
    recorded = _read_log(events)
    old = await _Replay(events, recorded, None).run()
    new = await _Replay(events, recorded, changes).run() if changes is not None else old
    return SchedulerWhatIf(old, new, recorded, len(events))
