"""Telemetry handlers: ingest evidence, correlate it to the attempt placed on its node, (re)elect the finding.

Two consumers, each under the consumer contract (a batch per transaction, outputs through the outbox; in a
batch the finding is elected once per attempt, just before the commit):

- evidence (`lanes.tel.>`): store it; when a placement explains its node and time, publish a compact
  correlated copy on the job's subject (not for raw, unrecognised lines) and re-elect when the evidence
  can change the finding;
- job facts (`placed`, `resources_released`, `rank_started`, `rank_exited`, `state_changed`,
  `settle_window_ended`): telemetry's own copy of where each rank runs and how it ended; evidence that arrived
  before its placement is correlated then. A rank's exit is evidence itself, and it says how much evidence its
  agent sent, so telemetry knows when the rank's story is complete (see `domain/settlement.py`).

Evidence from a rank's output names its job, attempt and rank (its producer knows them). Node-level evidence
(a kernel line) is matched to a rank by the pid it names, then to the one attempt placed on the node at that
time; where several attempts share the node and no pid decides, it is filed under none of them rather than
under a guess.

A finding is published only when it differs from the previous one, as the next `version`; it says whether it
is settled, so recovery acts on settled findings only.
"""

from __future__ import annotations

import bisect
import signal
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from lanes_contract.events import (
    Event,
    JobEvidence,
    JobEvidenceData,
    JobFinding,
    JobPlaced,
    JobStateChanged,
    Lane,
    RankExited,
    RankStarted,
    ResourcesReleased,
    SettleWindowEnded,
    derive,
)
from lanes_contract.ids import is_valid_token
from lanes_contract.jobs import JobState
from lanes_evidence.evidence import Evidence, from_event
from lanes_runtime.consumer import Caused, HandlerContext
from lanes_telemetry.adapters.repository import PostgresTelemetryStore
from lanes_telemetry.domain.election import (
    ALWAYS_REELECT_UP_TO,
    DEFAULT_CAUSE_WINDOW,
    World,
    may_be_cause,
    worth_reelecting,
)
from lanes_telemetry.domain.election import (
    NOT_ELECTED as NOT_ELECTED_CATEGORIES,
)
from lanes_telemetry.domain.settlement import (
    DEFAULT_SETTLE_WINDOW,
    AttemptStory,
    RankExit,
    may_explain,
    settled_finding,
)
from lanes_telemetry.service_layer.ports import (
    NewEvidence,
    Placement,
    PlacementSpan,
    StoredEvidence,
    StoreFactory,
    TelemetryStore,
    placements_at,
)

SOURCE = "lanes/telemetry"
CORRELATION_SKEW = timedelta(seconds=2)
"""Evidence this much before a placement (node clocks disagree) still belongs to it."""
NOT_ELECTED = tuple(sorted(category.value for category in NOT_ELECTED_CATEGORIES))
_COPY_LINES = 3
_NODE_LANES = frozenset({Lane.HOST, Lane.NETWORK})
"""The lanes whose first errors are the node's own fault (what makes a node a repeat offender)."""
_COPY_LINE_CHARS = 512
_SPANS_MARGIN = timedelta(minutes=10)
"""How far around an event's time a batch reads a node's placements once, for the batch's later events."""
# Keys of what one transaction (a batch) keeps in its scope. Values are replaced, never mutated in place, so
# a scope restored after a failed event (a savepoint rolled back) holds exactly what was there before it.
_LOCKED = "telemetry.locked_nodes"
_SPANS = "telemetry.placement_spans"
_UNSAVED = "telemetry.unsaved_evidence"
_UNSENT = "telemetry.unsent_copies"
CONSEQUENCE_COPIES = 8
"""Consequences of one category (collective timeouts, aborts) copied to an attempt's timeline; the rest are
counted in the finding's consequence groups and stay on the telemetry stream."""


async def handle_evidence(event: Event, ctx: HandlerContext) -> Sequence[Event]:
    """Store one piece of evidence (telemetry on PostgreSQL under the default settle window)."""
    return await Telemetry().handle_evidence(event, ctx)


async def _evidence(
    event: Event, store: TelemetryStore, ctx: HandlerContext, cause_window: timedelta = DEFAULT_CAUSE_WINDOW
) -> Sequence[Event]:
    """Store one piece of evidence, correlate it, and return its job copy and any new finding."""
    if event.node is None or not hasattr(event.data, "category"):
        return ()
    evidence = from_event(event)
    node = event.node
    await _lock_node(ctx, store, node)
    job_id, attempt = event.jobid, event.attempt
    sharing: list[Placement] = []
    if job_id is None or attempt is None:
        job_id, attempt, rank, sharing = await _owner_of(ctx, store, node, evidence)
        if evidence.rank is None and rank is not None:
            evidence = Evidence(evidence.data, evidence.time, node, rank, evidence.id)
    new = NewEvidence(event.id, evidence, node, event.lane.value, ctx.stream_seq, job_id, attempt)
    if sharing:
        await store.save_evidence([new])  # the shared filings below refer to its row
    else:
        await _save_evidence(ctx, store, new)
    if evidence.category.value in NOT_ELECTED:
        # Unrecognised lines stay on LANES_TELEMETRY and in the evidence table, but do not flood the
        # job's year-long audit timeline: only evidence that means something to a lane is copied there.
        return ()
    if sharing:
        return await _shared(store, event, evidence, sharing)
    if job_id is None or attempt is None:
        return ()
    copies = await _copy_to_timeline(
        ctx, store, [_Copy(event, job_id, attempt, StoredEvidence(event.id, event.lane.value, evidence))]
    )
    return [*copies, *await _reelect(ctx, store, event, job_id, attempt, [evidence], cause_window=cause_window)]


async def _lock_node(ctx: HandlerContext, store: TelemetryStore, node: str) -> None:
    """Lock `node` for this transaction (shared, until it commits), unless it holds the lock already.

    The batch's other nodes (its subject keys) not locked yet are locked with it: one statement, one order, and
    the batch's later events find their node locked.
    """
    locked: frozenset[str] = ctx.scope.cache.get(_LOCKED, frozenset())
    if node in locked:
        return
    wanted = [each for each in {node, *ctx.scope.keys} if each not in locked]
    await store.lock_nodes(wanted, exclusive=False)
    ctx.scope.cache[_LOCKED] = locked | frozenset(wanted)


async def _save_evidence(ctx: HandlerContext, store: TelemetryStore, new: NewEvidence) -> None:
    """Store evidence now, or, in a batch, with the batch's other evidence in one statement before the commit.

    The batch's elections run after that statement (they are registered after it), so they read it all.
    """
    if not ctx.scope.deferred:
        await store.save_evidence([new])
        return
    unsaved: tuple[NewEvidence, ...] | None = ctx.scope.cache.get(_UNSAVED)
    if unsaved is None:
        scope = ctx.scope

        async def save() -> list[tuple[Event, Event]]:
            items = scope.cache.pop(_UNSAVED, ())
            if items:
                await store.save_evidence(items)
            return []

        scope.before_commit(save)
    ctx.scope.cache[_UNSAVED] = (*(unsaved or ()), new)


class _NodeWindow:
    """A node's placements between two times, as one batch read them, and the answers already given.

    Which spans include a time depends only on how many spans start by it and how many end before it (the
    starts and ends sorted), so the answer for one such pair is the answer for every time with that pair:
    a storm's thousand lines from one node cost one `placements_at`, not a thousand.
    """

    def __init__(self, low: datetime, high: datetime, spans: list[PlacementSpan]) -> None:
        self.low, self.high, self.spans = low, high, spans
        self._starts = sorted(span.placed_at - CORRELATION_SKEW for span in spans)
        self._ends = sorted(span.released_at + CORRELATION_SKEW for span in spans if span.released_at is not None)
        self._answers: dict[tuple[int, int], list[Placement]] = {}
        """Filled in place: it only remembers a function of the spans, right whatever the scope rolls back."""

    def placements_at(self, at: datetime) -> list[Placement]:
        """The attempts placed on the node at `at` (`placements_at` over the spans, remembered)."""
        phase = (bisect.bisect_right(self._starts, at), bisect.bisect_left(self._ends, at))
        answer = self._answers.get(phase)
        if answer is None:
            answer = self._answers[phase] = placements_at(self.spans, at, CORRELATION_SKEW)
        return answer


async def _placements_at(ctx: HandlerContext, store: TelemetryStore, node: str, at: datetime) -> list[Placement]:
    """The attempts on `node` at `at`, from the node's placements this batch has read (under its node lock).

    One read covers the batch's evidence within minutes of the first, for this node and the batch's other nodes
    not read yet (its subject keys); evidence further away reads again. The filter is the same either way
    (`placements_at`), so the answer is the one a query would give.
    """
    cached: dict[str, _NodeWindow] = ctx.scope.cache.get(_SPANS, {})
    since, until = at - CORRELATION_SKEW, at + CORRELATION_SKEW
    window = cached.get(node)
    if window is None or since < window.low or until > window.high:
        low, high = since - _SPANS_MARGIN, until + _SPANS_MARGIN
        nodes = [node, *sorted(key for key in ctx.scope.keys if key not in cached and key != node)]
        spans = await store.placement_spans(nodes, low, high)
        read = {each: _NodeWindow(low, high, spans[each]) for each in nodes}
        ctx.scope.cache[_SPANS] = cached | read
        window = read[node]
    return window.placements_at(at)


async def _owner_of(
    ctx: HandlerContext, store: TelemetryStore, node: str, evidence: Evidence
) -> tuple[str | None, int | None, int | None, list[Placement]]:
    """Whose node-level evidence this is: (job, attempt, rank), or the attempts that share it.

    By the pid it names first, else the one attempt placed on the node then. Where several attempts share the
    node and nothing decides, it is shared evidence: filed under each, never elected as anyone's first error.
    """
    at = evidence.time
    if at is None:
        return None, None, None, []
    candidates = await _placements_at(ctx, store, node, at)
    if evidence.data.pid is not None:
        owner = await store.process_of_pid(node, evidence.data.pid, candidates)
        if owner is not None:
            return (*owner, [])
    if len(candidates) == 1:
        return candidates[0].job_id, candidates[0].attempt, candidates[0].only_rank, []
    return None, None, None, candidates


async def _shared(store: TelemetryStore, event: Event, evidence: Evidence, sharing: Sequence[Placement]) -> list[Event]:
    """File node-level evidence under every attempt sharing the node, labelled shared (it elects nobody)."""
    stored = StoredEvidence(event.id, event.lane.value, evidence)
    copies: list[Event] = []
    for placement in sharing:
        await store.share_evidence(event.id, placement.job_id, placement.attempt)
        copy = _copy(_Copy(event, placement.job_id, placement.attempt, stored, key=f"shared:{placement.job_id}"))
        copies.append(copy.model_copy(update={"data": copy.data.model_copy(update={"shared": True})}))
    return copies


async def handle_job_event(event: Event, ctx: HandlerContext) -> Sequence[Event]:
    """Keep telemetry's copy of placements and processes (on PostgreSQL, under the default settle window)."""
    return await Telemetry().handle_job_event(event, ctx)


class Telemetry:
    """Telemetry's two handlers, on a store (the port) and under a settle window."""

    def __init__(
        self,
        settle_window: timedelta = DEFAULT_SETTLE_WINDOW,
        *,
        store: StoreFactory = PostgresTelemetryStore,
        cause_window: timedelta = DEFAULT_CAUSE_WINDOW,
    ) -> None:
        self.settle_window = settle_window
        self.cause_window = cause_window
        """How long before an attempt's first exit evidence may still explain it."""
        self._store = store

    async def handle_evidence(self, event: Event, ctx: HandlerContext) -> Sequence[Event]:
        """Store one piece of evidence, correlate it, and return its job copy and any new finding."""
        return await _evidence(event, self._store(ctx.conn), ctx, self.cause_window)

    async def handle_job_event(self, event: Event, ctx: HandlerContext) -> Sequence[Event]:
        """Fold one job fact; re-elect when it can change the finding or settle it."""
        if event.attempt is None:
            return ()
        store = self._store(ctx.conn)
        job_id, attempt = event.job_key, event.attempt
        if isinstance(event, RankStarted) and event.rank is not None:
            if event.data.pid is not None:  # an observed job's scheduler may not see the process
                await store.save_started(job_id, attempt, event.rank, event.node, event.data.pid)
            return ()
        if isinstance(event, RankExited) and event.rank is not None:
            data = event.data
            # A SIGKILL that only enforced the agent's own stop is that stop (SIGTERM): it waits for no kernel
            # line and explains nothing, as a rank that obeyed the SIGTERM would not.
            killed = signal.SIGTERM if data.killed_after_grace_s is not None else data.signal
            ex = RankExit(event.rank, event.node, data.exit_code, killed, event.time, data.evidence, event.id)
            await store.save_exit(job_id, attempt, ex)
            if may_explain(ex) or _election_pending(ctx, job_id, attempt) or await store.load_finding(job_id, attempt):
                return await _reelect(ctx, store, event, job_id, attempt, force=True, cause_window=self.cause_window)
            return ()
        if isinstance(event, JobStateChanged) and event.data.to_state is JobState.FAILED:
            await store.attempt_ended(job_id, attempt, event.time, self.settle_window)
            return ()
        if isinstance(event, SettleWindowEnded):
            await store.end_window(job_id, attempt)
            return await _reelect(ctx, store, event, job_id, attempt, force=True, cause_window=self.cause_window)
        return await _placements(event, store, ctx, self.cause_window)


async def _placements(
    event: Event, store: TelemetryStore, ctx: HandlerContext, cause_window: timedelta
) -> Sequence[Event]:
    if isinstance(event, ResourcesReleased):
        await store.release(event.job_key, event.attempt, event.time)
        return ()
    if not isinstance(event, JobPlaced) or event.attempt is None:
        return ()
    job_id, attempt = event.job_key, event.attempt
    ranks_by_node: dict[str, tuple[int, ...]] = {}
    for assignment in event.data.assignments:
        ranks_by_node[assignment.node] = (*ranks_by_node.get(assignment.node, ()), assignment.rank)
    await store.lock_nodes(list(ranks_by_node), exclusive=True)
    await store.save_placement(job_id, attempt, event.data.assignments, event.time)
    late = await store.correlate_late(job_id, attempt, ranks_by_node, event.time - CORRELATION_SKEW)
    if not late:
        return ()
    recognised = [stored for stored in late if stored.evidence.category.value not in NOT_ELECTED]
    copies = await _copy_to_timeline(
        ctx, store, [_Copy(event, job_id, attempt, stored, key=stored.event_id) for stored in recognised]
    )
    new = [s.evidence for s in late]
    return [*copies, *await _reelect(ctx, store, event, job_id, attempt, new, cause_window=cause_window)]


@dataclass(frozen=True)
class _Copy:
    """Evidence to copy to its job's timeline, and the event the copy derives from."""

    cause: Event
    job_id: str
    attempt: int
    stored: StoredEvidence
    key: str = ""


async def _copy_to_timeline(ctx: HandlerContext, store: TelemetryStore, copies: Sequence[_Copy]) -> list[Event]:
    """Copy evidence to its job's timeline: now, or, in a batch, with the batch's other copies before the commit.

    In a batch the copies' counters are read and added to in one statement, and the copies go to the outbox
    in the order their evidence came.
    """
    if not copies:
        return []
    if not ctx.scope.deferred:
        return [copy for _, copy in await _copies_within_cap(store, copies)]
    unsent: tuple[_Copy, ...] | None = ctx.scope.cache.get(_UNSENT)
    if unsent is None:
        scope = ctx.scope

        async def send() -> list[Caused]:
            return await _copies_within_cap(store, scope.cache.pop(_UNSENT, ()))

        scope.before_commit(send)
    ctx.scope.cache[_UNSENT] = (*(unsent or ()), *copies)
    return []


async def _copies_within_cap(store: TelemetryStore, copies: Sequence[_Copy]) -> list[Caused]:
    """The copies to publish, with their causes: every possible cause, and consequences up to the cap.

    A timeline is read by people: 1,023 ranks timing out in one all-reduce are one fact, which the finding's
    consequence groups state with the ranks and nodes. The first CONSEQUENCE_COPIES of a category show what
    the lines looked like; the last of them says that no more are copied.
    """
    wanted = Counter(_category_of(copy) for copy in copies if not may_be_cause(copy.stored.evidence))
    counted = await store.count_consequences(wanted) if wanted else {}
    published: list[Caused] = []
    for copy in copies:
        if may_be_cause(copy.stored.evidence):
            published.append((copy.cause, _copy(copy)))
            continue
        category = _category_of(copy)
        number = counted[category] = counted[category] + 1
        if number <= CONSEQUENCE_COPIES:
            published.append((copy.cause, _copy(copy, last_of_category=number == CONSEQUENCE_COPIES)))
    return published


def _category_of(copy: _Copy) -> tuple[str, int, str]:
    return copy.job_id, copy.attempt, copy.stored.evidence.category.value


def _copy(copy: _Copy, *, last_of_category: bool = False) -> JobEvidence:
    cause, stored = copy.cause, copy.stored
    evidence = stored.evidence
    compact = evidence.data.model_copy(
        update={"lines": tuple(line[:_COPY_LINE_CHARS] for line in evidence.data.lines[:_COPY_LINES])}
    )
    return derive(
        JobEvidence,
        cause,
        key=copy.key,
        source=SOURCE,
        jobid=copy.job_id,
        attempt=copy.attempt,
        node=evidence.node,
        rank=evidence.rank,
        time=evidence.time or cause.time,
        lane=Lane(stored.lane),
        data=JobEvidenceData(evidence_id=stored.event_id, evidence=compact, last_copy_of_category=last_of_category),
    )


_ELECTIONS = "telemetry.elections"
"""The scope's cache key of the attempts whose election waits for the end of the batch."""


@dataclass
class _PendingElection:
    cause: Event
    new: list[Evidence] = field(default_factory=list)
    force: bool = False


def _election_pending(ctx: HandlerContext, job_id: str, attempt: int) -> bool:
    return (job_id, attempt) in ctx.scope.cache.get(_ELECTIONS, {})


async def _reelect(  # noqa: PLR0917 - the election's inputs, as _maybe_reelect takes them
    ctx: HandlerContext,
    store: TelemetryStore,
    cause: Event,
    job_id: str,
    attempt: int,
    new: Sequence[Evidence] = (),
    *,
    force: bool = False,
    cause_window: timedelta = DEFAULT_CAUSE_WINDOW,
) -> Sequence[Event]:
    """Elect over `new` evidence (or at all, when `force`): at once, or in a batch once per attempt.

    In a batch the election runs just before the commit, over everything the batch stored: an election
    reads the attempt's whole evidence, so electing per event made a 1,024-rank storm quadratic. The
    result is the same finding the last per-event election would give (it is a function of what is
    stored); only the intermediate versions, stale before they were published, are skipped.
    """
    if not ctx.scope.deferred:
        return await (
            _elect(store, cause, job_id, attempt, cause_window)
            if force
            else _maybe_reelect(store, cause, job_id, attempt, new, cause_window)
        )
    elections: dict[tuple[str, int], _PendingElection] | None = ctx.scope.cache.get(_ELECTIONS)
    if elections is None:
        elections = ctx.scope.cache[_ELECTIONS] = {}
        scope = ctx.scope

        async def elect() -> list[Caused]:
            found: list[Caused] = []
            # Attempt by attempt in one order: each election locks its attempt until the commit, so two
            # transactions electing the same attempts (replicas, batches in flight) wait rather than deadlock.
            for (job, number), pending in sorted(scope.cache.pop(_ELECTIONS).items()):
                events = await (
                    _elect(store, pending.cause, job, number, cause_window)
                    if pending.force
                    else _maybe_reelect(store, pending.cause, job, number, pending.new, cause_window)
                )
                found += [(pending.cause, event) for event in events]
            return found

        scope.before_commit(elect)
    pending = elections.setdefault((job_id, attempt), _PendingElection(cause))
    pending.cause = cause  # the finding follows from the batch's last event that touched the attempt
    pending.new += new
    pending.force = pending.force or force
    return ()


async def _maybe_reelect(  # noqa: PLR0917 - the election's inputs, as _elect takes them
    store: TelemetryStore, cause: Event, job_id: str, attempt: int, new: Sequence[Evidence], cause_window: timedelta
) -> Sequence[Event]:
    considered = [item for item in new if item.category.value not in NOT_ELECTED]
    if not considered:
        return ()
    # Under the attempt's lock: another transaction adding reporters meanwhile has committed, and is counted.
    await store.lock_attempt(job_id, attempt)
    elect = any(may_be_cause(item) for item in considered)
    count = await store.count_evidence(job_id, attempt, ignored=NOT_ELECTED, up_to=ALWAYS_REELECT_UP_TO)
    before, after = await store.add_reporters(job_id, attempt, [(item.node or "", item.rank) for item in considered])
    # As if the reporters had come one by one: any of the counts they passed through may warrant an election.
    passed: list[int | None] = list(range(before + 1, after + 1)) or [None]
    world_size = await store.world_size(job_id, attempt) if not elect and after > before else 0
    elect = elect or any(worth_reelecting(evidence_count=count, new_reporters=n, world_size=world_size) for n in passed)
    if not elect:
        return ()
    return await _elect(store, cause, job_id, attempt, cause_window)


async def _elect(
    store: TelemetryStore, cause: Event, job_id: str, attempt: int, cause_window: timedelta
) -> Sequence[Event]:
    """Re-elect the attempt's finding over its evidence and exits; publish it if it changed."""
    await store.lock_attempt(job_id, attempt)
    story = AttemptStory(
        world=World(ranks=await store.world_of(job_id, attempt)),
        evidence=await store.evidence_of(job_id, attempt, ignored=NOT_ELECTED),
        exits=await store.exits_of(job_id, attempt),
        heard=await store.heard_per_rank(job_id, attempt),
        window_ended=await store.window_ended(job_id, attempt),
        cause_window=cause_window,
    )
    finding = settled_finding(story)
    first = finding.first_error
    if first is not None and first.node and first.lane in _NODE_LANES:
        # Only the node's own faults make it a repeat offender: a script's exception or an exit nobody
        # explains says nothing about the node it ran on, however many jobs it ends there.
        repeats = await store.other_jobs_first_error_on(first.node, job_id)
        if repeats:
            summary = f"{first.summary}; repeat offender: {first.node} was the first error of {repeats} other job(s)"
            finding = finding.model_copy(update={"first_error": first.model_copy(update={"summary": summary})})
    previous = await store.load_finding(job_id, attempt)
    comparable = finding.model_dump(mode="json", exclude={"version", "evidence_count"})
    if previous is not None and {k: v for k, v in previous[1].items() if k in comparable} == comparable:
        return ()
    version = (previous[0] if previous else 0) + 1
    finding = finding.model_copy(update={"version": version})
    await store.save_finding(job_id, attempt, finding)
    first = finding.first_error
    return [
        derive(
            JobFinding,
            cause,
            key=f"{job_id}/{attempt}/v{version}",
            source=SOURCE,
            jobid=job_id,
            attempt=attempt,
            # The finding names what it names; the envelope's node must be a valid subject token.
            node=first.node if first and first.node and is_valid_token(first.node) else None,
            rank=first.rank if first else None,
            lane=first.lane if first else Lane.PLATFORM,
            data=finding,
        )
    ]
