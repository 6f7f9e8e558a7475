"""The scheduler's ports held in memory, for a replay of the recorded past (`lanes whatif scheduler`).

A what-if runs the real handlers (`service_layer/handlers.py`) and through them the admission core over a
recorded log, without PostgreSQL. The repository keeps what the PostgreSQL tables keep (nodes, policy,
attempts, GPU allocations, the open wait reason of each attempt) with the same rules: an attempt is queued
once, released once, and a GPU is held by one attempt at a time (the primary key of the allocations table,
here a `DoubleBookingError`). One replay runs one handler call at a time, so the lock is a no-op.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from lanes_contract.events import NodeRegisteredData
from lanes_contract.jobs import JobSpec
from lanes_contract.topology import ClusterPolicy, Node, NodeStatus
from lanes_runtime.consumer import Caused
from lanes_scheduler.domain.admission import Gang, Holding, Placed
from lanes_scheduler.domain.queue import PendingJob, Release, gang_of
from lanes_scheduler.service_layer.ports import QueuedAttempt, WaitEnd, WaitUpdate


class DoubleBookingError(RuntimeError):
    """A GPU given to a second attempt while another holds it: what the allocations' primary key refuses."""


Shape = tuple[str, int, str | None, int | None, frozenset[str]]
"""What decides where one worker of a waiting attempt fits: pool, GPUs per worker, model, memory, avoided nodes."""


@dataclass
class _Attempt:
    spec: JobSpec
    seq: int
    avoid_nodes: tuple[str, ...]
    status: str = "pending"
    wait: tuple[str, str, int | None] | None = None
    """The open wait reason: (reason, detail, queue position)."""

    @property
    def shape(self) -> Shape:
        spec = self.spec
        return (spec.pool, spec.gpus_per_worker, spec.gpu_model, spec.gpu_memory_gib, frozenset(self.avoid_nodes))


class MemoryScheduling:
    """The `SchedulingRepository` port in dicts; the same object serves every "transaction"."""

    def __init__(self) -> None:
        self._token = ""  # no change of capacity written yet
        self._nodes: dict[str, Node] = {}
        self._policy = ClusterPolicy()
        self._attempts: dict[tuple[str, int], _Attempt] = {}
        self._held: dict[tuple[str, int], dict[str, list[int]]] = {}
        self._gpu_holder: dict[tuple[str, int], tuple[str, int]] = {}
        self._pending_shapes: Counter[Shape] = Counter()
        self.releases_refused: dict[str, int] = {}
        """Release requests refused, by outcome (double_release, unknown_attempt), as the releases table logs them."""

    async def lock_scheduling(self) -> None:
        """Nothing to serialize: one replay makes one call at a time."""

    async def state_token(self) -> str:
        """See `SchedulingRepository.state_token`."""
        return self._token

    async def set_state_token(self, token: str) -> None:
        """See `SchedulingRepository.set_state_token`."""
        self._token = token

    async def upsert_node(self, node_id: str, data: NodeRegisteredData) -> None:
        """Record a node; a re-registration changes its inventory, not its state."""
        known = self._nodes.get(node_id)
        fields = data.model_dump(include=set(Node.model_fields) - {"node_id", "status"})
        status = known.status if known is not None else NodeStatus()
        self._nodes[node_id] = Node(node_id=node_id, status=status, **fields)

    async def set_node_state(self, node_id: str, status: NodeStatus) -> bool:
        """See `SchedulingRepository.set_node_state`."""
        known = self._nodes.get(node_id)
        if known is None:
            return False
        self._nodes[node_id] = known.model_copy(update={"status": status})
        return True

    async def set_policy(self, policy: ClusterPolicy) -> None:
        """See `SchedulingRepository.set_policy`."""
        self._policy = policy

    async def policy(self) -> ClusterPolicy:
        """See `SchedulingRepository.policy`."""
        return self._policy

    async def nodes(self) -> list[Node]:
        """Every known node, by id (the order PostgreSQL returns them in)."""
        return [self._nodes[n] for n in sorted(self._nodes)]

    async def holdings(self) -> list[Holding]:
        """See `SchedulingRepository.holdings`, ordered by attempt and node as the SQL orders them."""
        out: list[Holding] = []
        for ref in sorted(self._held):
            spec = self._attempts[ref].spec
            for node, gpus in sorted(self._held[ref].items()):
                out.append(Holding(f"{ref[0]}/{ref[1]}", spec.tenant, spec.pool, node, tuple(sorted(gpus))))
        return out

    async def add_pending_jobs(self, queued: Sequence[QueuedAttempt]) -> set[tuple[str, int]]:
        """See `SchedulingRepository.add_pending_jobs`."""
        added: set[tuple[str, int]] = set()
        for q in queued:
            ref = (q.job_id, q.attempt)
            if ref not in self._attempts:
                attempt = _Attempt(q.spec, q.seq, tuple(sorted(set(q.avoid_nodes))))
                self._attempts[ref] = attempt
                self._pending_shapes[attempt.shape] += 1
                added.add(ref)
        return added

    async def original_spec(self, job_id: str) -> JobSpec | None:
        """See `SchedulingRepository.original_spec`."""
        attempts = sorted(a for j, a in self._attempts if j == job_id)
        return self._attempts[job_id, attempts[0]].spec if attempts else None

    async def pending_jobs(self) -> list[PendingJob]:
        """See `SchedulingRepository.pending_jobs` (in queue order, as the SQL orders them)."""
        rows = sorted(((a.seq, ref) for ref, a in self._attempts.items() if a.status == "pending"))
        out = []
        for _, ref in rows:
            a = self._attempts[ref]
            reason, detail, position = a.wait or (None, None, None)
            gang = gang_of(ref[0], ref[1], a.spec, a.seq, avoid_nodes=a.avoid_nodes)
            out.append(PendingJob(gang, reason, detail, position))
        return out

    async def allocate(self, placed: Sequence[Placed]) -> None:
        """Hold the placements' GPUs; a GPU another attempt holds is refused, as the primary key refuses it."""
        for p in placed:
            ref = (p.gang.job_id, p.gang.attempt)
            for assignment in p.assignments:
                for gpu in assignment.gpus:
                    holder = self._gpu_holder.get((assignment.node, gpu))
                    if holder is not None:
                        taker, owner = f"{ref[0]}/{ref[1]}", f"{holder[0]}/{holder[1]}"
                        msg = f"GPU {gpu} of {assignment.node} given to {taker} while {owner} holds it"
                        raise DoubleBookingError(msg)
                    self._gpu_holder[assignment.node, gpu] = ref
                    self._held.setdefault(ref, {}).setdefault(assignment.node, []).append(gpu)
            self._set_status(self._attempts[ref], "placed")

    async def reject(self, gang: Gang) -> None:
        """See `SchedulingRepository.reject`."""
        self._set_status(self._attempts[gang.job_id, gang.attempt], "rejected")

    async def release(self, job_id: str, attempt: int, cause_id: str, at: datetime) -> Release:
        """Free a finished attempt's GPUs exactly once; a second request or an unknown attempt is refused."""
        del cause_id, at
        ref = (job_id, attempt)
        known = self._attempts.get(ref)
        if known is None or known.status == "done":
            outcome = "double_release" if known is not None else "unknown_attempt"
            self.releases_refused[outcome] = self.releases_refused.get(outcome, 0) + 1
            return Release(outcome)
        self._set_status(known, "done")
        held = self._held.pop(ref, {})
        for node, gpus in held.items():
            for gpu in gpus:
                del self._gpu_holder[node, gpu]
        return Release("released", tuple(sorted(held)), sum(len(g) for g in held.values()))

    def _set_status(self, attempt: _Attempt, status: str) -> None:
        if attempt.status == "pending":
            self._pending_shapes[attempt.shape] -= 1
            if not self._pending_shapes[attempt.shape]:
                del self._pending_shapes[attempt.shape]
        attempt.status = status
        attempt.wait = None

    def waiting_shapes(self) -> frozenset[Shape]:
        """The distinct shapes of the attempts waiting for placement (what a free GPU could be used by)."""
        return frozenset(self._pending_shapes)

    async def close_waits(self, ended: Sequence[WaitEnd]) -> None:
        """See `SchedulingRepository.close_waits`."""
        for end in ended:
            known = self._attempts.get((end.job_id, end.attempt))
            if known is not None:
                known.wait = None

    async def record_waits(self, updates: Sequence[WaitUpdate]) -> None:
        """See `SchedulingRepository.record_waits`: the open reason of each attempt, with its details."""
        for update in updates:
            gang = update.waiting.gang
            waiting = update.waiting
            self._attempts[gang.job_id, gang.attempt].wait = (
                waiting.reason.value,
                waiting.detail,
                waiting.queue_position,
            )


@dataclass
class MemoryBatch:
    """The `Batch` port: events applied together, the queue decided once after the last of them."""

    cache: dict[object, Any] = field(default_factory=dict)
    actions: list[Callable[[], Awaitable[Sequence[Caused] | None]]] = field(default_factory=list)

    def before_commit(self, action: Callable[[], Awaitable[Sequence[Caused] | None]]) -> None:
        """See `Batch.before_commit`."""
        self.actions.append(action)

    async def commit(self) -> list[Caused]:
        """Run the work left for after the batch's last event; return what it published, with its causes."""
        published: list[Caused] = []
        for action in self.actions:
            published.extend(await action() or ())
        self.actions.clear()
        return published


@dataclass(frozen=True)
class MemoryUnitOfWork:
    """One event's unit of work on the in-memory repository, inside a batch or alone."""

    repo: MemoryScheduling
    stream_seq: int
    batch: MemoryBatch | None = None
