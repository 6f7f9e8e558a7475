"""First-error election: which rank, node, link or line of code failed first, and which lane owns it.

When 255 ranks time out together, the timeouts are consequences. The election:

0. reads only evidence recent enough to explain the attempt's end: a cause logged long before the first
   exit (a harmless exception minutes earlier, a GPU error the job survived) did not end it,
1. attributes evidence to ranks (a kernel OOM kill names a pid; torchelastic names the rank of that pid),
2. separates causes (process death, Xid, ECC, link down, exception...) from consequences (collective
   timeouts, peer-closed sockets, aborts, SIGTERMs sent by torchrun to the survivors),
3. drops causes on ranks that kept completing collectives after another rank stopped (sequence numbers
   first), then takes the earliest cause by time corrected by each node's clock offset, treating causes
   within the skew tolerance as simultaneous and preferring the lower layer among them (an Xid explains
   the CUDA error it provokes, not the other way round),
4. when no cause exists, reads the hang itself: the rank that never enqueued the collective the others
   wait on, a node that reported nothing, the peer every socket error names; only then the network,
5. groups the consequences, names the stage, lists the missing evidence per lane, and the owner to call.

An exit status that nothing else explains (no error line, no kernel, agent or network evidence) is elected
as an `unexplained_exit` in the platform lane, never as the node's fault: a script that exits 3 without a
word says nothing about its host, and the finding names the evidence that would explain it.

Pure: evidence in, finding out.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from enum import StrEnum
from functools import total_ordering

from lanes_contract.events import (
    ConsequenceGroup,
    EvidenceCategory,
    FindingCause,
    JobFindingData,
    Lane,
    MissingEvidence,
)
from lanes_contract.ids import is_valid_token
from lanes_evidence.evidence import Evidence, lane_of
from lanes_evidence.flight_recorder import is_flight_recorder_evidence, missing_dumps_what

C = EvidenceCategory
DEFAULT_SKEW_TOLERANCE = timedelta(seconds=2)
"""Causes closer than this (after clock-offset correction) are treated as simultaneous."""
DEFAULT_CAUSE_WINDOW = timedelta(seconds=300)
"""How long before an attempt's first exit evidence may still explain it (LANES_CAUSE_WINDOW_S).

Five minutes: a failing rank takes its peers down within seconds (a crash, a kill) or after their
collective timeout, and that timeout stretches the window by itself (see `_window_start`), so the default
only has to cover the slow ways to die that report no timeout: a checkpoint write that fails after minutes
of retries, an OOM after a slow leak past its first warning. Anything older (an exception a server logged
and survived, an Xid the job outlived) did not end the attempt.
"""
UNEXPLAINED_EXIT = "unexplained_exit"
"""The category of a first error that is only an exit status: no evidence says why the rank exited."""
_MAX_CHAIN = 6
_LISTED_NODES = 8
_SIGKILL, _SIGABRT, _SIGTERM, _SIGINT = 9, 6, 15, 2
_FIRST_COLLECTIVE_MAX_SEQ = 1


class Stage(StrEnum):
    """Where communication waited when the job failed."""

    INIT_RENDEZVOUS = "init_rendezvous"
    FIRST_COLLECTIVE = "first_collective"
    STEADY_STATE = "steady_state"
    CHECKPOINT = "checkpoint"
    TEARDOWN = "teardown"
    UNKNOWN = "unknown"


_PRIORITY: dict[EvidenceCategory, int] = {
    C.GPU_XID: 90,
    C.ECC_ERROR: 90,
    C.NODE_LOST: 88,
    C.OOM_KILL: 85,
    C.LINK_DOWN: 80,
    C.AGENT_FAULT: 78,
    C.LINK_FLAP: 80,
    C.RETRY_EXCEEDED: 70,
    C.DISK_FULL: 70,
    C.PREEMPTION: 70,
    C.CONFIG_MISMATCH: 65,
    C.RESOURCE_EXHAUSTED: 62,
    C.PORT_ERRORS: 60,
    C.COLLECTIVE_MISMATCH: 57,
    C.CUDA_ERROR: 55,
    C.CUDA_OOM: 55,
    C.NUMERIC_ANOMALY: 52,
    C.PYTHON_EXCEPTION: 50,
    C.CONNECT_FAILED: 47,
    C.RENDEZVOUS_FAILURE: 42,
    C.COMM_INIT_FAILURE: 40,
}
"""Cause strength: among simultaneous causes the lower layer explains the higher one."""
_SIGNAL_DEATH_PRIORITY = 45
_AFTER_A_TIMEOUT_IS_A_CONSEQUENCE = frozenset({C.PROCESS_EXITED, C.COMM_INIT_FAILURE, C.RENDEZVOUS_FAILURE})
"""A rank's exit or a re-rendezvous after its own collectives timed out happens *because* of them."""
_EXIT_CODE_PRIORITY = 20
NOT_ELECTED = frozenset({C.RAW, C.PROCESS_STARTED})
HANG_READINGS = frozenset({"collective_not_enqueued", "silent_node", "silent_rank", "peer_lost", "collective_hang"})
"""Categories of a first error read from a hang (no cause among the evidence), not from one piece of evidence."""
_IGNORED = NOT_ELECTED | {C.CLOCK_OFFSET, C.LINK_UP}
"""Evidence the election does not read at all: a rank whose log holds only these said nothing about the
failure (no error, no timeout), which in a hang is exactly what makes it interesting. A live service may
leave these out of the election's input and get the same finding."""

OWNERS: dict[Lane, str] = {
    Lane.ALGORITHM: "algorithm team (the model's owner)",
    Lane.PLATFORM: "platform on-call",
    Lane.HOST: "host team (OS, GPU and driver on-call)",
    Lane.NETWORK: "network team (fabric on-call)",
}


@dataclass(frozen=True)
class World:
    """Who should have reported: every rank with the node it was placed on, and every node."""

    ranks: Mapping[int, str | None] = field(default_factory=dict)
    nodes: frozenset[str] = frozenset()

    @property
    def all_nodes(self) -> frozenset[str]:
        """The nodes, including those only known through a rank's placement."""
        return self.nodes | {node for node in self.ranks.values() if node}


@dataclass(frozen=True)
class _Item:
    evidence: Evidence
    at: datetime | None
    """Time corrected by the node's clock offset."""


def elect_first_error(
    evidence: Iterable[Evidence],
    *,
    world: World | None = None,
    skew_tolerance: timedelta = DEFAULT_SKEW_TOLERANCE,
    version: int = 1,
    ended_at: datetime | None = None,
    cause_window: timedelta = DEFAULT_CAUSE_WINDOW,
) -> JobFindingData:
    """Elect the first error among `evidence` (any order), for a job placed as `world` says.

    `ended_at`: when the attempt began to end (its first rank exit). Evidence from more than `cause_window`
    before it (stretched by the longest collective timeout reported) is not read: it did not end the attempt.
    None (an offline analysis that knows no exit): every piece of evidence is read.
    """
    world = world or World()
    # A canonical order first: the finding must not depend on the order evidence arrived in.
    every = sorted(evidence, key=_evidence_key)
    chosen = [e for e in every if e.category not in NOT_ELECTED]
    items = sorted(_correct_clocks(_attribute(chosen, world, _pid_clues(every))), key=_canonical)
    if ended_at is not None:
        items = _recent(items, ended_at, cause_window)
    consequence_seen = _first_consequence_time(items)
    causes = [item for item in items if _is_cause(item, consequence_seen)]
    progress = _progress_by_rank(items)
    first: FindingCause | None
    if causes:
        cause, chain, contenders = _elect_cause(causes, progress, skew_tolerance)
        first = _cause_of(cause, chain, _rank_of_rankless(items, cause, skew_tolerance, world))
        if cause.evidence.category is C.COLLECTIVE_MISMATCH:
            first = _blame_odd_one_out(first, items, world)
        confidence = _confidence(cause, contenders)
        if first.rank is None and first.node is not None and len(_placed_on(world, first.node)) > 1:
            confidence -= _UNKNOWN_RANK_PENALTY  # the node is known, but not which of its ranks
        used = {id(item) for item in chain}
    else:
        first, confidence = _explain_hang(items, world)
        used = set()
    consequences = _group(item for item in items if id(item) not in used)
    missing = _missing(items, world, first)
    if missing and first is not None:
        confidence = max(0.05, confidence - 0.1)
    return JobFindingData(
        version=version,
        first_error=first,
        consequences=tuple(consequences),
        stage=_stage(items, first),
        missing_evidence=tuple(missing),
        confidence=round(confidence, 2),
        owner=_owner(first),
        evidence_count=len(items),
    )


def may_be_cause(evidence: Evidence) -> bool:
    """Whether this evidence can change who is elected (a live service re-elects at once for these)."""
    return _priority(evidence) is not None


ALWAYS_REELECT_UP_TO = 64
"""Up to this much evidence per attempt, every piece re-runs the election (it is cheap at that size)."""


def worth_reelecting(*, evidence_count: int, new_reporters: int | None, world_size: int) -> bool:
    """Whether a consequence should re-run the election of its attempt (a possible cause always does).

    Beyond ALWAYS_REELECT_UP_TO pieces of evidence, re-electing on each of 1,024 timeouts would re-read
    the attempt's evidence 1,024 times: then only a new reporter re-elects, when the number of reporters
    doubles or reaches the world size, so the grouped consequences and the pending evidence are
    refreshed log2(n) times and once complete.
    """
    if evidence_count <= ALWAYS_REELECT_UP_TO:
        return True
    if new_reporters is None or new_reporters < 1:
        return False
    return new_reporters & (new_reporters - 1) == 0 or new_reporters >= world_size


_UNKNOWN_RANK_PENALTY = 0.15


def _placed_on(world: World, node: str) -> list[int]:
    return [rank for rank, placed in world.ranks.items() if placed == node]


# --- attribution ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _PidClues:
    """What lines the election does not elect still say about processes (read before they are set aside)."""

    rank_of_pid: Mapping[tuple[str | None, int], int]
    """(node, pid) -> rank, from any line that carries both (an NCCL INFO line `host:pid:tid` in a rank's log)."""
    cleaned_up: Mapping[tuple[str | None, str], frozenset[int]]
    """(node, GPU) -> the pids an aftermath Xid (45: preemptive cleanup) names on that GPU."""


def _pid_clues(evidence: list[Evidence]) -> _PidClues:
    """Pid clues from all the evidence, unrecognised lines included.

    An Xid 149 names no process, but the Xid 45 that cleans up after it on the same GPU does, and an NCCL INFO
    line in a rank's log pairs that pid with the rank. A live service that drops raw lines loses only this rank.
    """
    rank_of_pid: dict[tuple[str | None, int], int] = {}
    cleaned: dict[tuple[str | None, str], set[int]] = defaultdict(set)
    for e in evidence:
        if e.rank is not None and e.data.pid is not None:
            rank_of_pid.setdefault((e.node, e.data.pid), e.rank)
            rank_of_pid.setdefault((None, e.data.pid), e.rank)
        if e.data.xid in _AFTERMATH_XIDS and e.data.pid is not None and e.data.gpu:
            cleaned[(e.node, e.data.gpu)].add(e.data.pid)
    return _PidClues(rank_of_pid, {key: frozenset(pids) for key, pids in cleaned.items()})


_AFTERMATH_XIDS = frozenset({45})


def _attribute(evidence: list[Evidence], world: World, clues: _PidClues | None = None) -> list[Evidence]:
    """Fill in the rank of node-level evidence and the node of rank-level evidence.

    A node-level line gets the rank of the pid it names (or of the one pid an Xid 45 cleaned up on its GPU), or
    the only rank placed on its node (as the live service does on ingest: offline and live must elect the same).
    """
    rank_of_pid: dict[tuple[str | None, int], int] = dict(clues.rank_of_pid) if clues else {}
    for e in evidence:
        if e.rank is not None and e.data.pid is not None:
            rank_of_pid.setdefault((e.node, e.data.pid), e.rank)
            rank_of_pid.setdefault((None, e.data.pid), e.rank)
    placed: dict[str, list[int]] = defaultdict(list)
    for placed_rank, placed_node in world.ranks.items():
        if placed_node is not None:
            placed[placed_node].append(placed_rank)
    attributed: list[Evidence] = []
    for e in evidence:
        rank, node = e.rank, e.node
        if rank is None and e.data.pid is not None:
            rank = rank_of_pid.get((node, e.data.pid))
        if rank is None and e.data.pid is None and e.data.gpu and clues is not None:
            pids = clues.cleaned_up.get((node, e.data.gpu), frozenset())
            if len(pids) == 1:
                rank = rank_of_pid.get((node, next(iter(pids))))
        if rank is None and node is not None and len(placed[node]) == 1:
            rank = placed[node][0]  # a node that runs one rank: its node-level evidence is that rank's
        if node is None and rank is not None:
            node = world.ranks.get(rank)
        attributed.append(e if (rank, node) == (e.rank, e.node) else replace(e, rank=rank, node=node))
    return attributed


def _correct_clocks(evidence: list[Evidence]) -> list[_Item]:
    offsets: dict[str, float] = {}
    for e in evidence:
        if e.category is C.CLOCK_OFFSET and e.node and e.data.offset_ms is not None:
            offsets[e.node] = e.data.offset_ms
    return [
        _Item(e, None if e.time is None else e.time - timedelta(milliseconds=offsets.get(e.node or "", 0.0)))
        for e in evidence
    ]


def _recent(items: list[_Item], ended_at: datetime, cause_window: timedelta) -> list[_Item]:
    """The items recent enough to explain an attempt that began to end at `ended_at` (undated ones too)."""
    start = _window_start(items, ended_at, cause_window)
    return [item for item in items if item.at is None or item.at >= start]


def _window_start(items: list[_Item], ended_at: datetime, cause_window: timedelta) -> datetime:
    """The earliest moment a cause may date from: the window before the end, stretched by a collective timeout.

    Ranks that report a collective timeout waited that long (Timeout(ms)) for a peer before they gave up
    and exited: what stopped the peer happened up to that long before, so the window covers it too. Only
    timeouts reported inside the plain window count, so an old one cannot stretch the window to itself.
    """
    start = ended_at - cause_window
    waited = [
        item.evidence.data.timeout_ms
        for item in items
        if item.evidence.category is C.COLLECTIVE_TIMEOUT
        and item.evidence.data.timeout_ms is not None
        and item.at is not None
        and item.at >= start
    ]
    return start - timedelta(milliseconds=max(waited)) if waited else start


def _first_consequence_time(items: list[_Item]) -> dict[tuple[str | None, int | None], datetime]:
    seen: dict[tuple[str | None, int | None], datetime] = {}
    for item in items:
        e = item.evidence
        if item.at is not None and e.rank is not None and _is_consequence_category(e):
            key = (e.node, e.rank)
            seen[key] = min(seen.get(key, item.at), item.at)
    return seen


def _is_consequence_category(e: Evidence) -> bool:
    return e.category in {C.COLLECTIVE_TIMEOUT, C.PEER_CLOSED, C.COMM_ERROR}


def _priority(e: Evidence) -> int | None:
    if e.category is C.PROCESS_EXITED:
        if e.data.signal is not None:
            # SIGABRT is the NCCL watchdog taking the process down; SIGTERM / SIGINT come from torchrun
            # stopping the survivors: consequences. Any other signal (SIGKILL, SIGSEGV) is a death.
            return None if e.data.signal in {_SIGABRT, _SIGTERM, _SIGINT} else _SIGNAL_DEATH_PRIORITY
        return _EXIT_CODE_PRIORITY if e.data.exit_code not in {None, 0} else None
    return _PRIORITY.get(e.category)


def _is_cause(item: _Item, consequence_seen: Mapping[tuple[str | None, int | None], datetime]) -> bool:
    e = item.evidence
    priority = _priority(e)
    if priority is None:
        return False
    if e.category in _AFTER_A_TIMEOUT_IS_A_CONSEQUENCE and priority < _SIGNAL_DEATH_PRIORITY:
        # A rank that exits with an error after its collectives timed out exits *because* of them.
        seen = consequence_seen.get((e.node, e.rank))
        if seen is not None and item.at is not None and seen <= item.at:
            return False
    return True


def _progress_by_rank(items: list[_Item]) -> dict[int, int]:
    """The last collective each rank is known to have completed."""
    progress: dict[int, int] = {}
    for item in items:
        e = item.evidence
        if e.rank is None:
            continue
        done = e.data.last_completed
        if done is None and e.category is C.COLLECTIVE_TIMEOUT and e.data.seq_num is not None:
            done = max(e.data.seq_num - 1, 0)
        if done is not None:
            progress[e.rank] = min(progress.get(e.rank, done), done)
    return progress


# --- electing among causes -----------------------------------------------------------------------


def _elect_cause(
    causes: list[_Item], progress: Mapping[int, int], tolerance: timedelta
) -> tuple[_Item, list[_Item], list[_Item]]:
    known = [p for c in causes if (p := _progress_of(c, progress)) is not None]
    if known:
        # A rank that completed collectives after another rank stopped cannot have failed first.
        least = min(known)
        causes = [c for c in causes if (p := _progress_of(c, progress)) is None or p <= least]
    timed = [c for c in causes if c.at is not None]
    if timed:
        start = min(c.at for c in timed if c.at is not None)
        # A cause without a time (an lspci listing, a line before any timestamp) cannot be placed after the
        # first one: it competes with it.
        window = [c for c in causes if c.at is None or c.at <= start + tolerance]
    else:
        window = causes
    # The strongest, then the earliest; among equals the one that says more (a rank, a node) tells the story:
    # srun's "task 6: Out Of Memory" over slurmstepd's anonymous OOM count of the same moment.
    winner = max(
        window,
        key=lambda c: (
            _priority(c.evidence) or 0,
            -_timestamp(c),
            c.evidence.rank is not None,
            c.evidence.node is not None,
        ),
    )
    chain = _chain(winner, causes, window)
    chained = {id(c) for c in chain}
    contenders = [
        c
        for c in window
        if id(c) not in chained
        and c.evidence.node != winner.evidence.node
        and (_priority(c.evidence) or 0) >= (_priority(winner.evidence) or 0) - 10
    ]
    return winner, chain, contenders


def _progress_of(item: _Item, progress: Mapping[int, int]) -> int | None:
    rank = item.evidence.rank
    return None if rank is None else progress.get(rank)


def _evidence_key(e: Evidence) -> tuple[float, str, int, str, tuple[str, ...], int, _Whole]:
    moment = e.time.timestamp() if e.time is not None else float("inf")
    pid = -1 if e.data.pid is None else e.data.pid
    return (moment, e.node or "", -1 if e.rank is None else e.rank, e.category.value, e.data.lines, pid, _Whole(e))


def _canonical(item: _Item) -> tuple[float, str, int, str, tuple[str, ...], _Whole]:
    e = item.evidence
    return (_timestamp(item), e.node or "", -1 if e.rank is None else e.rank, e.category.value, e.data.lines, _Whole(e))


@total_ordering
@dataclass(frozen=True, eq=False)
class _Whole:
    """The last word of a sort key: the whole evidence, so that no two different pieces ever tie.

    Two pieces that agree on time, place, category and lines may still differ (a peer, a sequence number),
    and which of them leads can change the finding. Compared lazily: a sort only reaches it on a tie.
    """

    evidence: Evidence

    def _value(self) -> tuple[str, str]:
        e = self.evidence
        return e.data.model_dump_json(), repr((e.time, e.node, e.rank, e.id))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Whole) and self._value() == other._value()

    def __lt__(self, other: _Whole) -> bool:
        return self._value() < other._value()

    __hash__ = None  # type: ignore[assignment]  # compared, never hashed


def _timestamp(item: _Item) -> float:
    return item.at.timestamp() if item.at is not None else float("inf")


def _chain(winner: _Item, causes: list[_Item], window: list[_Item]) -> list[_Item]:
    """The winner and the evidence that tells the same story: same rank, node or pid, or naming its node."""
    w = winner.evidence
    in_window = {id(c) for c in window}

    def related(c: _Item) -> bool:
        e = c.evidence
        same_pid = w.data.pid is not None and e.data.pid == w.data.pid and e.node == w.node
        same_place = (w.rank is not None and e.rank == w.rank) or (e.node is not None and e.node == w.node)
        names_it = e.data.peer is not None and e.data.peer == w.node
        return same_pid or ((same_place or names_it) and id(c) in in_window)

    chain = [winner, *(c for c in causes if c is not winner and related(c))]
    chain.sort(key=_canonical)
    return chain[:_MAX_CHAIN]


def _rank_of_rankless(items: list[_Item], winner: _Item, tolerance: timedelta, world: World) -> int | None:
    """The rank a rank-less cause is about, when the evidence names only one (else None).

    The one rank of its node that reported anything within the skew tolerance after it (an Xid, then that
    rank's CUDA / NCCL error), or else the one rank whose process exited with an error where the cause's
    node allows it (an unprefixed traceback, then torchrun's report of the rank that failed), or else, for a
    GPU lost on the node, the one rank placed there that never said a word: its GPU went, and its process
    with it, while its neighbours went on to time out.
    """
    node, at = winner.evidence.node, winner.at
    if node is not None and at is not None:
        right_after = {
            i.evidence.rank
            for i in items
            if i.evidence.node == node
            and i.evidence.rank is not None
            and i.at is not None
            and at <= i.at <= at + tolerance
        }
        if len(right_after) == 1:
            return right_after.pop()
    failed = {
        i.evidence.rank
        for i in items
        if i.evidence.category is C.PROCESS_EXITED
        and i.evidence.rank is not None
        and _priority(i.evidence) is not None
        and (node is None or i.evidence.node in {None, node})
    }
    if len(failed) == 1:
        return failed.pop()
    if node is not None and winner.evidence.category in _GPU_FAULTS:
        heard = {i.evidence.rank for i in items if i.evidence.rank is not None}
        unheard = [rank for rank in _placed_on(world, node) if rank not in heard]
        if len(unheard) == 1:
            return unheard[0]
    return None


_GPU_FAULTS = frozenset({C.GPU_XID, C.ECC_ERROR})
_FINGERPRINT = re.compile(r"Rank (\d{1,7}) is running collective: CollectiveFingerPrint\([^)]*?OpType=(\w+)")


def _blame_odd_one_out(first: FindingCause, items: list[_Item], world: World) -> FindingCause:
    """A collective mismatch is the fault of the rank that called what no one else did, not of its reporter.

    Each report names two ranks and their collectives; every rank's timeout names the collective it waits in.
    Counting one collective per rank, the ranks outside the clear majority are the odd ones out (the lowest is
    named); a tie (two ranks, one against one) leaves the reporter named, as the log does.
    """
    op_of: dict[int, str] = {}
    for item in items:
        e = item.evidence
        if e.category is C.COLLECTIVE_MISMATCH:
            for line in e.data.lines:
                for rank, op in _FINGERPRINT.findall(line):
                    op_of.setdefault(int(rank), op)
    for item in items:
        e = item.evidence
        if e.category is C.COLLECTIVE_TIMEOUT and e.rank is not None and e.data.op_type:
            op_of.setdefault(e.rank, e.data.op_type)
    counts = Counter(op_of.values()).most_common()
    if len(counts) <= 1 or counts[0][1] == counts[1][1]:
        return first  # all agree (nothing to settle), or no majority to be odd against
    odd = sorted(rank for rank, op in op_of.items() if op != counts[0][0])
    rank = odd[0]
    if rank == first.rank:
        return first
    summary = (
        f"rank {rank} called {op_of[rank]} where {counts[0][1]} ranks called {counts[0][0]}: "
        f"the odd one out (reported by rank {first.rank})"
    )
    return first.model_copy(update={"rank": rank, "node": world.ranks.get(rank), "summary": summary})


def _cause_of(winner: _Item, chain: list[_Item], rank_of_rankless: int | None) -> FindingCause:
    e = winner.evidence
    rank = e.rank
    if rank is None:
        # Node-level evidence (an Xid, an OOM kill): the rank of the same story on that node, if one.
        ranks = {c.evidence.rank for c in chain if c.evidence.rank is not None and c.evidence.node == e.node}
        rank = min(ranks) if len(ranks) == 1 else rank_of_rankless
    lines = tuple(line for c in chain for line in c.evidence.data.lines)[: _MAX_CHAIN * 4]
    if _is_bare_exit_status(e):
        # The rank chose its exit status and said nothing about why: no evidence blames its node.
        who = f"rank {rank}" if rank is not None else "a rank"
        summary = f"{who} exited with status {e.data.exit_code} and no evidence explains it" + (
            f" ({e.node})" if e.node else ""
        )
        return FindingCause(
            category=UNEXPLAINED_EXIT, lane=Lane.PLATFORM, node=e.node, rank=rank, time=e.time, summary=summary,
            evidence=lines,
        )  # fmt: skip
    return FindingCause(
        category=e.category.value,
        lane=lane_of(e.data),
        node=e.node,
        rank=rank,
        time=e.time,
        summary=_describe(replace(e, rank=rank)),
        evidence=lines,
    )


def _is_bare_exit_status(e: Evidence) -> bool:
    """An exit by status, not by signal: the process's own choice, which says nothing about its node."""
    return e.category is C.PROCESS_EXITED and e.data.signal is None and e.data.exit_code not in {None, 0}


def _describe(e: Evidence) -> str:
    where = " ".join(part for part in (f"rank {e.rank}" if e.rank is not None else "", e.node or "") if part)
    what = e.data.summary or e.category.value.replace("_", " ")
    return f"{what} ({where})" if where else what


def _confidence(winner: _Item, contenders: list[_Item]) -> float:
    priority = _priority(winner.evidence) or 0
    base = 0.9 if priority >= _PRIORITY[C.LINK_DOWN] else 0.8 if priority >= _PRIORITY[C.PYTHON_EXCEPTION] else 0.6
    return base - 0.15 * min(len(contenders), 3)


# --- no cause: reading the hang ------------------------------------------------------------------


def _explain_hang(items: list[_Item], world: World) -> tuple[FindingCause | None, float]:
    timeouts = [i for i in items if i.evidence.category is C.COLLECTIVE_TIMEOUT and i.evidence.rank is not None]
    enqueued: dict[int, int] = {}
    for item in timeouts:
        e = item.evidence
        value = e.data.last_enqueued if e.data.last_enqueued is not None else e.data.seq_num
        if value is not None and e.rank is not None:
            enqueued[e.rank] = max(enqueued.get(e.rank, value), value)
    if enqueued:
        waited_on = max(enqueued.values())
        laggards = sorted((seq, rank) for rank, seq in enqueued.items() if seq < waited_on)
        if laggards:
            seq, rank = laggards[0]
            lines = tuple(line for i in timeouts if i.evidence.rank == rank for line in i.evidence.data.lines)[
                :_MAX_CHAIN
            ]
            node = next((i.evidence.node for i in timeouts if i.evidence.rank == rank), None) or world.ranks.get(rank)
            others = len(enqueued) - len(laggards)
            summary = (
                f"rank {rank} never enqueued SeqNum={waited_on} (last enqueued {seq}) while {others} ranks waited "
                "in it: stuck before the collective, in its own code or data loading"
            )
            return FindingCause(
                category="collective_not_enqueued",
                lane=Lane.ALGORITHM,
                node=node,
                rank=rank,
                time=_earliest(i for i in timeouts if i.evidence.rank == rank),
                summary=summary,
                evidence=lines,
            ), 0.6
    # Who stayed silent about the hang: a rank the teardown stopped said nothing, whatever its exit.
    spoke = [i for i in items if _said_something(i)]
    silent = _silent_nodes(spoke, world)
    if len(silent) > 1 and _has_consequences(items):
        # Several nodes said nothing (yet): which of them the others wait on is a guess, so none is named.
        listed = ", ".join(sorted(silent)[:_LISTED_NODES]) + (", ..." if len(silent) > _LISTED_NODES else "")
        summary = f"{len(silent)} nodes reported nothing while the others waited ({listed}): none is named yet"
        return FindingCause(category="silent_node", lane=Lane.HOST, summary=summary), 0.25
    if silent and _has_consequences(items):
        node = min(silent)
        ranks = sorted(r for r, n in world.ranks.items() if n == node)
        summary = f"{node} reported nothing while the others waited on it" + (
            f" (ranks {_ranges(ranks)})" if ranks else ""
        )
        return FindingCause(
            category="silent_node",
            lane=Lane.HOST,
            node=node,
            rank=ranks[0] if len(ranks) == 1 else None,
            summary=summary,
        ), 0.4
    if timeouts:
        # A rank whose node reports while it says nothing (no timeout of its own, while the others time
        # out waiting for it) never reached the collective: the laggard, seen by its silence.
        reported, _ = _reporting(spoke)
        quiet = sorted(r for r, n in world.ranks.items() if r not in reported and n not in silent)
        if quiet:
            rank = quiet[0]
            waited = sorted(enqueued)
            return FindingCause(
                category="silent_rank",
                lane=Lane.ALGORITHM,
                node=world.ranks.get(rank),
                rank=rank,
                summary=(
                    f"rank{'s' if len(quiet) > 1 else ''} {_ranges(quiet)} reported no error and no timeout while "
                    f"{len(waited) or len(reported)} ranks timed out waiting: never reached the collective"
                ),
            ), 0.45 if len(quiet) == 1 else 0.3
    peers = Counter(
        i.evidence.data.peer for i in items if i.evidence.category is C.PEER_CLOSED and i.evidence.data.peer
    )
    if peers:
        return _peer_finding(items, world, *peers.most_common(1)[0])
    comm = [i for i in items if _is_consequence_category(i.evidence)]
    if comm:
        first = min(comm, key=_timestamp)
        e = first.evidence
        # Nothing else explains it: only now is the collective itself (the fabric) the suspect.
        return FindingCause(
            category="collective_hang",
            lane=Lane.NETWORK,
            node=e.node,
            rank=e.rank,
            time=e.time,
            summary=f"every rank that reported waited in the same collective; no cause found ({_describe(e)})",
            evidence=e.data.lines,
        ), 0.3
    return None, 0.0


def _peer_finding(items: list[_Item], world: World, peer: str, count: int) -> tuple[FindingCause, float]:
    """Connections closed by `peer`: the peer's fault only when nothing on the peer's side came first."""
    closed = [i for i in items if i.evidence.category is C.PEER_CLOSED and i.evidence.data.peer == peer]
    evidence = tuple(line for i in closed for line in i.evidence.data.lines)[:_MAX_CHAIN]
    node = _peer_node(peer, world)
    first_closed = min(_timestamp(i) for i in closed)
    alive = [
        i
        for i in items
        if node is not None
        and i.evidence.node == node
        and i.evidence.category is not C.PEER_CLOSED
        and _timestamp(i) <= first_closed
    ]
    if alive:
        # The peer was still there, waiting or failing on its own side, before the others lost it: the
        # connection between them failed, not the peer.
        waited = alive[0].evidence
        summary = (
            f"{count} connection(s) to {peer} were lost while {node} itself was alive and already reporting "
            f"({_describe(waited)}): the link between them"
        )
        lines = (*evidence, *waited.data.lines)[:_MAX_CHAIN]
        return FindingCause(
            category="peer_link_lost", lane=Lane.NETWORK, node=node, summary=summary, evidence=lines
        ), 0.35
    summary = (
        f"{count} connection(s) were closed by {peer} and nothing on its side came first: its process died or its "
        "host went away"
    )
    return FindingCause(category="peer_lost", lane=Lane.HOST, node=node, summary=summary, evidence=evidence), 0.4


def _earliest(items: Iterable[_Item]) -> datetime | None:
    times = [i.evidence.time for i in items if i.evidence.time is not None]
    return min(times) if times else None


def _peer_node(peer: str, world: World) -> str | None:
    """The node a peer names: a known node, or a host name's first label; never an address."""
    if peer in world.all_nodes:
        return peer
    if re.fullmatch(r"\d{1,3}(?:\.\d{1,3}){3}", peer):
        return peer.replace(".", "-")  # as the parsers name a host known only by its address
    if _looks_like_address(peer):
        return None
    label = peer.split(".", 1)[0]
    return label if is_valid_token(label) else None


def _looks_like_address(peer: str) -> bool:
    return peer.replace(".", "").replace(":", "").isdigit() or peer.count(":") > 1


def _has_consequences(items: list[_Item]) -> bool:
    return any(_is_consequence_category(i.evidence) for i in items)


def _said_something(item: _Item) -> bool:
    """Whether the item is the rank's (or node's) own word on the failure.

    An exit by the teardown's SIGTERM (or SIGINT) is not: every rank still there when the gang was stopped
    ends so, the hung one included, and counting it would hide the one rank that never said anything.
    """
    e = item.evidence
    return not (e.category is C.PROCESS_EXITED and e.data.signal in {_SIGTERM, _SIGINT})


def _reporting(items: list[_Item]) -> tuple[set[int], set[str]]:
    ranks = {i.evidence.rank for i in items if i.evidence.rank is not None}
    nodes = {i.evidence.node for i in items if i.evidence.node is not None}
    return ranks, nodes


def _silent_nodes(items: list[_Item], world: World) -> set[str]:
    ranks, nodes = _reporting(items)
    # A node is silent when neither it nor any rank placed on it reported anything.
    heard = nodes | {world.ranks.get(rank) or "" for rank in ranks}
    return set(world.all_nodes - heard)


# --- consequences, stage, missing evidence -------------------------------------------------------


def _group(items: Iterable[_Item]) -> list[ConsequenceGroup]:
    timeouts: dict[tuple[str | None, int | None], dict[str, object]] = {}
    others: dict[tuple[object, ...], set[tuple[str | None, int | None]]] = defaultdict(set)
    summaries: dict[tuple[object, ...], str] = {}
    for item in items:
        e = item.evidence
        if e.category in _IGNORED:
            continue
        who = (e.node, e.rank)
        if e.category is C.COLLECTIVE_TIMEOUT:
            seen = timeouts.setdefault(who, {})
            for name, value in (("op", e.data.op_type), ("timeout", e.data.timeout_ms)):
                if value is not None:
                    seen.setdefault(name, value)
            if e.data.seq_num is not None:
                seen["seq"] = max(int(str(seen.get("seq", 0))), e.data.seq_num)
            continue
        key = (e.category, e.data.peer, e.data.signal, e.data.exit_code, e.data.error_type)
        others[key].add(who)
        summaries.setdefault(key, e.data.summary or e.category.value)
    grouped: dict[tuple[object, ...], set[tuple[str | None, int | None]]] = defaultdict(set)
    for who, seen in timeouts.items():
        grouped[("timeout", seen.get("op"), seen.get("seq"), seen.get("timeout"))].add(who)
    groups = [_timeout_group(key, members) for key, members in grouped.items()]
    groups += [_other_group(key, members, summaries[key]) for key, members in others.items()]
    groups.sort(key=lambda g: (-g.count, g.category, g.summary))
    return groups


def _members(members: set[tuple[str | None, int | None]]) -> tuple[tuple[int, ...], tuple[str, ...], str]:
    ranks = tuple(sorted({r for _, r in members if r is not None}))
    nodes = tuple(sorted({n for n, _ in members if n is not None}))
    if ranks:
        noun = f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''}"
    elif nodes:
        noun = f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}"
    else:
        noun = "unattributed"
    return ranks, nodes, noun


def _timeout_group(key: tuple[object, ...], members: set[tuple[str | None, int | None]]) -> ConsequenceGroup:
    _, op, seq, timeout = key
    ranks, nodes, noun = _members(members)
    summary = f"{noun} timed out in {op or 'a collective'}"
    if seq is not None:
        summary += f" SeqNum={seq}"
    if isinstance(timeout, int):
        summary += f" after {timeout / 1000:g} s"
    return ConsequenceGroup(
        category=C.COLLECTIVE_TIMEOUT.value,
        summary=summary,
        count=max(len(ranks) or len(nodes), 1),
        ranks=ranks,
        nodes=nodes,
    )


def _other_group(
    key: tuple[object, ...], members: set[tuple[str | None, int | None]], summary: str
) -> ConsequenceGroup:
    category = key[0]
    ranks, nodes, noun = _members(members)
    label = category.value if isinstance(category, EvidenceCategory) else str(category)
    return ConsequenceGroup(
        category=label,
        summary=f"{noun}: {summary}"[:300],
        count=max(len(ranks) or len(nodes), 1),
        ranks=ranks,
        nodes=nodes,
    )


_KERNEL_CATEGORIES = frozenset({C.OOM_KILL, C.GPU_XID, C.ECC_ERROR, C.NODE_LOST})
_INIT_CATEGORIES = frozenset({C.COMM_INIT_FAILURE, C.RENDEZVOUS_FAILURE})
_CHECKPOINT_WORDS = ("checkpoint", "save_state", "torch.save", "dcp.save")
_TEARDOWN_WORDS = ("destroy_process_group", "shutdown", "atexit")


def _stage(items: list[_Item], first: FindingCause | None) -> str:
    texts = [line.lower() for line in first.evidence] if first else []
    texts += [
        line.lower() for i in items if i.evidence.category is C.PYTHON_EXCEPTION for line in i.evidence.data.lines
    ]
    if any(word in text for text in texts for word in _CHECKPOINT_WORDS):
        return Stage.CHECKPOINT.value
    if any(word in text for text in texts for word in _TEARDOWN_WORDS):
        return Stage.TEARDOWN.value
    seqs = [i.evidence.data.seq_num for i in items if i.evidence.data.seq_num is not None]
    if seqs:
        return (Stage.FIRST_COLLECTIVE if max(seqs) <= _FIRST_COLLECTIVE_MAX_SEQ else Stage.STEADY_STATE).value
    if any(i.evidence.category in _INIT_CATEGORIES for i in items) or any("bootstrap" in text for text in texts):
        return Stage.INIT_RENDEZVOUS.value
    return Stage.UNKNOWN.value


def _missing(items: list[_Item], world: World, first: FindingCause | None) -> list[MissingEvidence]:
    reporting_ranks, reporting_nodes = _reporting(items)
    missing: list[MissingEvidence] = []
    silent = _silent_nodes(items, world)
    for node in sorted(silent):
        missing.append(MissingEvidence(lane=Lane.HOST, node=node, what=f"kernel log and process exit status of {node}"))
        missing.append(
            MissingEvidence(lane=Lane.NETWORK, node=node, what=f"NIC link state and port counters of {node}")
        )
    quiet: dict[str | None, list[int]] = defaultdict(list)
    for rank, rank_node in sorted(world.ranks.items()):
        if rank not in reporting_ranks and rank_node not in silent:
            quiet[rank_node].append(rank)
    for quiet_node, ranks in sorted(quiet.items(), key=lambda kv: (kv[0] or "", kv[1])):
        # One entry per node, not per rank: 1,000 silent ranks must not make a 1,000-line finding.
        label = f"an error or timeout report from rank{'s' if len(ranks) > 1 else ''} {_ranges(ranks)}"
        where = f" on {quiet_node}" if quiet_node else ""
        missing.append(
            MissingEvidence(
                lane=Lane.PLATFORM, node=quiet_node, rank=ranks[0] if len(ranks) == 1 else None, what=label + where
            )
        )
    missing += _missing_dumps(items, world)
    if first is not None and first.lane is Lane.NETWORK and first.node:
        missing.append(
            MissingEvidence(
                lane=Lane.NETWORK, node=first.node, what=f"switch port counters for the links of {first.node}"
            )
        )
    if first is not None and first.category == C.PROCESS_EXITED.value:
        # A death by signal with no kernel line beside it: who sent the signal (the OOM killer?) is unread.
        kernel_seen = any(
            i.evidence.category in _KERNEL_CATEGORIES and i.evidence.node in {first.node, None} for i in items
        )
        if not kernel_seen:
            where = first.node or "the node"
            missing.append(
                MissingEvidence(lane=Lane.HOST, node=first.node, what=f"kernel log of {where}: who killed the process")
            )
    if first is not None and first.category == UNEXPLAINED_EXIT:
        who = f"rank {first.rank}" if first.rank is not None else "the rank"
        missing.append(
            MissingEvidence(
                lane=Lane.ALGORITHM,
                node=first.node,
                rank=first.rank,
                what=f"an error line in {who}'s own output saying why it exited (none was read)",
            )
        )
    if first is not None and first.category == "collective_not_enqueued" and first.rank is not None:
        missing.append(
            MissingEvidence(
                lane=Lane.ALGORITHM, node=first.node, rank=first.rank, what=f"stack dump (py-spy) of rank {first.rank}"
            )
        )
    del reporting_nodes
    return missing


def _missing_dumps(items: list[_Item], world: World) -> list[MissingEvidence]:
    """Once some ranks' Flight Recorder dumps are read, each rank of the world without one is pending evidence.

    The absent dump is the one that would settle whether its rank entered the collective the others last entered:
    a rank stopped, killed or stuck before it could dump is exactly the rank in question. One entry per node, as
    for silent ranks, so a thousand absent dumps stay a few lines.
    """
    recorded = [i.evidence for i in items if is_flight_recorder_evidence(i.evidence)]
    if not recorded:
        return []
    latest = max(recorded, key=lambda e: e.data.last_enqueued or e.data.seq_num or 0)
    collective = latest.data.last_enqueued or latest.data.seq_num or 0
    dumped = {e.rank for e in recorded}
    absent: dict[str | None, list[int]] = defaultdict(list)
    for rank, node in sorted(world.ranks.items()):
        if rank not in dumped:
            absent[node].append(rank)
    return [
        MissingEvidence(
            lane=Lane.PLATFORM,
            node=node,
            rank=ranks[0] if len(ranks) == 1 else None,
            what=missing_dumps_what(_ranges(ranks), len(ranks) > 1, collective, latest.data.op_type),
        )
        for node, ranks in sorted(absent.items(), key=lambda kv: (kv[0] or "", kv[1]))
    ]


def _owner(first: FindingCause | None) -> str:
    if first is None:
        return OWNERS[Lane.PLATFORM] + ": no evidence yet"
    where = " ".join(p for p in (first.node or "", f"rank {first.rank}" if first.rank is not None else "") if p)
    return f"{OWNERS[first.lane]}" + (f", about {where}" if where else "")


def _ranges(values: Sequence[int]) -> str:
    """1,2,3,7 -> '1-3,7'."""
    parts: list[str] = []
    start = prev = None
    for v in values:
        if start is None:
            start = prev = v
        elif prev is not None and v == prev + 1:
            prev = v
        else:
            parts.append(f"{start}-{prev}" if start != prev else f"{start}")
            start = prev = v
    if start is not None:
        parts.append(f"{start}-{prev}" if start != prev else f"{start}")
    return ",".join(parts)
