"""What telemetry's handlers need from the outside world, as a Protocol (cosmicpython's ports).

The handlers take a `TelemetryStore` opened on the consumer's transaction; PostgreSQL implements it in
`adapters/repository.py` (`PostgresTelemetryStore`), the unit tests an in-memory fake.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from lanes_contract.events import JobFindingData, JobSlowdownData, RankAssignment, StepTiming
from lanes_evidence.evidence import Evidence
from lanes_runtime.store import Db
from lanes_telemetry.domain.settlement import RankExit


@dataclass(frozen=True)
class Placement:
    """The attempt running on a node at some time, and the ranks it has there."""

    job_id: str
    attempt: int
    ranks: tuple[int, ...]

    @property
    def only_rank(self) -> int | None:
        """The rank when the node runs exactly one: node-level evidence then belongs to it."""
        return self.ranks[0] if len(self.ranks) == 1 else None


@dataclass(frozen=True)
class PlacementSpan:
    """One rank placed on a node: when, and (once released) until when."""

    job_id: str
    attempt: int
    rank: int
    placed_at: datetime
    released_at: datetime | None


def placements_at(spans: Sequence[PlacementSpan], at: datetime, skew: timedelta) -> list[Placement]:
    """The attempts among `spans` placed by `at` (+ skew) and not released before it (- skew), latest first."""
    ranks: dict[tuple[str, int], list[int]] = {}
    latest: dict[tuple[str, int], datetime] = {}
    for span in spans:
        if span.placed_at <= at + skew and (span.released_at is None or span.released_at >= at - skew):
            key = (span.job_id, span.attempt)
            ranks.setdefault(key, []).append(span.rank)
            latest[key] = max(latest.get(key, span.placed_at), span.placed_at)
    order = sorted(ranks, key=lambda key: latest[key], reverse=True)
    return [Placement(job, attempt, tuple(sorted(ranks[job, attempt]))) for job, attempt in order]


Reporter = tuple[str, int | None]
"""A (node, rank) that reported evidence for an attempt (rank None: the node itself)."""


@dataclass(frozen=True)
class NewEvidence:
    """A piece of evidence to store, with where it came from and whose it is (if known)."""

    event_id: str
    evidence: Evidence
    node: str
    lane: str
    stream_seq: int
    job_id: str | None
    attempt: int | None


@dataclass(frozen=True)
class StoredEvidence:
    """A row of telemetry_evidence as the election and the correlated copies need it."""

    event_id: str
    lane: str
    evidence: Evidence


class TelemetryStore(Protocol):
    """Telemetry's state for one transaction: placements, processes, evidence, findings, settle windows."""

    async def lock_nodes(self, nodes: Sequence[str], *, exclusive: bool) -> None:
        """Serialise correlation per node for this transaction (evidence vs. a placement arriving meanwhile).

        A placement locks its nodes `exclusive`: it correlates the evidence stored before it, so it waits for
        every transaction storing evidence on them. Evidence locks them shared: two batches of evidence do
        not wait for each other.
        """
        ...

    async def lock_attempt(self, job_id: str, attempt: int) -> None:
        """Serialise elections of one attempt: two transactions never publish the same finding version twice.

        The second also counts the attempt's reporters with those the first added.
        """
        ...

    async def save_placement(
        self, job_id: str, attempt: int, assignments: Sequence[RankAssignment], placed_at: datetime
    ) -> None:
        """Record where each rank of an attempt runs (a replayed placement overwrites itself)."""
        ...

    async def release(self, job_id: str, attempt: int | None, released_at: datetime) -> None:
        """Mark an attempt's placement as ended: later evidence on its nodes is no longer its evidence."""
        ...

    async def placement_at(self, node: str, at: datetime, skew: timedelta) -> Placement | None:
        """The latest attempt placed on `node` no later than `at` (+ skew) and not released before it."""
        ...

    async def world_of(self, job_id: str, attempt: int) -> dict[int, str | None]:
        """Every rank of the attempt with its node."""
        ...

    async def world_size(self, job_id: str, attempt: int) -> int:
        """How many ranks the attempt has."""
        ...

    async def save_evidence(self, items: Sequence[NewEvidence]) -> None:
        """Store pieces of evidence (a redelivered one is already there and is left as it is)."""
        ...

    async def add_reporters(self, job_id: str, attempt: int, reporters: Sequence[Reporter]) -> tuple[int, int]:
        """Record that these (node, rank) reported for the attempt; its number of reporters before and after."""
        ...

    async def count_consequences(self, added: Mapping[tuple[str, int, str], int]) -> dict[tuple[str, int, str], int]:
        """Add to the consequences counted per (job, attempt, category); return how many were counted before."""
        ...

    async def correlate_late(
        self, job_id: str, attempt: int, ranks_by_node: dict[str, tuple[int, ...]], since: datetime
    ) -> list[StoredEvidence]:
        """Attach evidence that arrived before the placement did (but happened after it) to the attempt."""
        ...

    async def evidence_of(self, job_id: str, attempt: int, *, ignored: Sequence[str]) -> list[Evidence]:
        """The attempt's evidence the election reads (categories in `ignored` are left out)."""
        ...

    async def count_evidence(self, job_id: str, attempt: int, *, ignored: Sequence[str], up_to: int) -> int:
        """How much evidence the attempt has for the election, counted no further than `up_to` + 1."""
        ...

    async def load_finding(self, job_id: str, attempt: int) -> tuple[int, dict[str, Any]] | None:
        """The latest finding's version and JSON body, if any."""
        ...

    async def save_finding(self, job_id: str, attempt: int, finding: JobFindingData) -> None:
        """Store the latest finding of an attempt."""
        ...

    async def other_jobs_first_error_on(self, node: str, job_id: str) -> int:
        """How many other jobs elected a host or network first error on this node (a repeat offender to drain)."""
        ...

    async def placement_spans(
        self, nodes: Sequence[str], since: datetime, until: datetime
    ) -> dict[str, list[PlacementSpan]]:
        """Each node's ranks placed by `until` and not released before `since` (every node a key)."""
        ...

    async def process_of_pid(self, node: str, pid: int, candidates: Sequence[Placement]) -> tuple[str, int, int] | None:
        """The (job, attempt, rank) among `candidates` whose process on `node` had this pid."""
        ...

    async def save_started(self, job_id: str, attempt: int, rank: int, node: str | None, pid: int) -> None:
        """Record a rank's pid (kernel lines name pids)."""
        ...

    async def save_exit(self, job_id: str, attempt: int, ex: RankExit) -> None:
        """Record how a rank ended (a redelivered exit overwrites itself)."""
        ...

    async def exits_of(self, job_id: str, attempt: int) -> dict[int, RankExit]:
        """The attempt's rank exits seen so far."""
        ...

    async def heard_per_rank(self, job_id: str, attempt: int) -> dict[int, int]:
        """How many evidence items arrived from each rank of the attempt."""
        ...

    async def attempt_ended(self, job_id: str, attempt: int, ended_at: datetime, window: timedelta) -> None:
        """Start a failed attempt's settle window (the first end seen counts; a redelivery changes nothing)."""
        ...

    async def end_window(self, job_id: str, attempt: int) -> None:
        """The attempt's settle window ran out: its finding settles on what arrived."""
        ...

    async def window_ended(self, job_id: str, attempt: int) -> bool:
        """Whether the attempt's settle window ran out."""
        ...

    async def share_evidence(self, event_id: str, job_id: str, attempt: int) -> None:
        """File node-level evidence under one of the attempts that shared its node (it elects none of them)."""
        ...


StoreFactory = Callable[[Db], TelemetryStore]
"""Opens the store on a transaction's connection."""


@dataclass(frozen=True)
class TimedStep:
    """One rank's timing of one step, as stored: the step, where the rank runs, its compute and wait."""

    rank: int
    step: int
    node: str
    compute_s: float
    wait_s: float


class StepTimingStore(Protocol):
    """Where the slow-rank reader keeps each rank's step timings and the one slowdown reported per attempt."""

    async def add(self, job_id: str, attempt: int, rank: int, node: str, timings: Sequence[StepTiming]) -> None:
        """Keep a rank's step timings (a redelivered heartbeat writes the same rows again)."""
        ...

    async def placed_node(self, job_id: str, attempt: int, rank: int) -> str | None:
        """The node the rank of the attempt was placed on (None: its placement not read yet)."""
        ...

    async def reported(self, job_id: str, attempt: int) -> bool:
        """Whether this attempt's slowdown is already reported, holding the attempt until the commit."""
        ...

    async def complete_steps(self, job_id: str, attempt: int, baseline: int, recent: int) -> list[TimedStep]:
        """The first `baseline` and last `recent` steps that every placed rank reported."""
        ...

    async def read_through(self, job_id: str, attempt: int) -> int:
        """The last step the attempt's timings were read up to (-1: none yet)."""
        ...

    async def set_read_through(self, job_id: str, attempt: int, step: int) -> None:
        """Remember how far the attempt's timings were read."""
        ...

    async def throttled_links(self, job_id: str, attempt: int) -> list[str]:
        """The attempt's nodes whose link was reported holding packets back (port errors) while it ran there."""
        ...

    async def gpus(self, job_id: str, attempt: int) -> int:
        """GPUs the attempt holds (0 when its placement is not known)."""
        ...

    async def save_report(self, job_id: str, attempt: int, report: JobSlowdownData) -> None:
        """Remember the attempt's reported slowdown."""
        ...


StepTimingFactory = Callable[[Db], StepTimingStore]
"""Opens the step-timing store on a transaction's connection."""
