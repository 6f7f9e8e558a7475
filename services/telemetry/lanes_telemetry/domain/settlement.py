"""Settlement: whether an attempt's finding can be acted on yet, and what it still waits for. Pure.

Evidence reaches telemetry in no particular order: a rank's timeout before the kernel line that explains it,
a rank's exit before the traceback it printed. A finding elected on part of the story is a guess, so each
finding says whether it is **settled**:

- every rank of the attempt is accounted for: its exit is known and every piece of evidence its agent
  published before that exit has arrived (the exit says how many); a rank killed by a signal the kernel
  sends for its node (SIGKILL: the OOM killer, or an operator?; SIGBUS: a memory or device fault) also waits
  for its node's kernel log; or
- the settle window ran out (it starts when the attempt ended): then the finding settles on what arrived,
  and says what never did.

Only evidence from the cause window before the attempt's first exit is elected (a server's harmless
exception sixteen minutes before its agent restarted did not end the attempt; the agent's fault did).

The lifecycle's own facts are evidence too: each rank's exit code or signal joins the election, so a rank
killed by signal 9 is a host-lane candidate ("killed by SIGKILL: OOM killer or operator; kernel log
pending") long before its kernel line arrives, and it outranks any "silent node" guess about the others.
"""

from __future__ import annotations

import signal
from collections import defaultdict
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from lanes_contract.events import EvidenceCategory, EvidenceData, JobFindingData
from lanes_evidence.evidence import Evidence
from lanes_telemetry.domain.election import DEFAULT_CAUSE_WINDOW, World, elect_first_error, may_be_cause

C = EvidenceCategory
SIGKILL = signal.SIGKILL.value
KERNEL_SIGNALS = frozenset({SIGKILL, signal.SIGBUS.value})
"""Signals the kernel delivers for a reason its own log names (the OOM killer; a memory or device fault).

The rank's agent cannot report that reason, so the finding waits for the node's kernel line (or the settle
window): elected without it, a GPU's Xid would lose to the bare exit it explains whenever the kernel line is
read a moment after the exit."""
DEFAULT_SETTLE_WINDOW = timedelta(seconds=5)
"""How long after an attempt ended its finding may still wait for late evidence (kernel logs, slow agents)."""
KERNEL_CATEGORIES = frozenset({C.OOM_KILL, C.GPU_XID, C.ECC_ERROR, C.DISK_FULL})
"""Node-level evidence that explains a process killed from outside (what a SIGKILL waits for)."""


@dataclass(frozen=True)
class RankExit:
    """How one rank's process ended, as the lifecycle's `rank_exited` says."""

    rank: int
    node: str | None
    exit_code: int | None
    signal: int | None
    time: datetime
    evidence: int | None = None
    """How many evidence events its agent published before the exit (None: an agent that does not say)."""
    id: str = ""
    pid: int | None = None

    @property
    def failed(self) -> bool:
        """Whether the rank ended badly (a non-zero status or any signal)."""
        return self.signal is not None or self.exit_code not in {None, 0}


@dataclass(frozen=True)
class AttemptStory:
    """Everything telemetry knows about one attempt when it (re)elects its finding."""

    world: World
    evidence: Sequence[Evidence]
    exits: Mapping[int, RankExit] = field(default_factory=dict)
    heard: Mapping[int, int] = field(default_factory=dict)
    """Evidence items received per rank (every category, raw lines included)."""
    window_ended: bool = False
    window: timedelta = DEFAULT_SETTLE_WINDOW
    cause_window: timedelta = DEFAULT_CAUSE_WINDOW
    """How long before the attempt's first exit evidence may still explain it (see `elect_first_error`)."""

    @property
    def ended_at(self) -> datetime | None:
        """When the attempt began to end: its first rank exit, whatever its status (None: no exit yet)."""
        return min((ex.time for ex in self.exits.values()), default=None)


@dataclass(frozen=True)
class Settlement:
    """Whether the finding is settled, why, and what it still waits for."""

    settled: bool
    reason: str
    waiting_for: tuple[str, ...]


def exit_evidence(story: AttemptStory) -> list[Evidence]:
    """The failed exits of the attempt, as evidence the election reads beside the agents' and kernels' lines."""
    explained = {e.node for e in story.evidence if e.category in KERNEL_CATEGORIES and e.node}
    return [_as_evidence(ex, explained) for ex in sorted(story.exits.values(), key=lambda x: x.rank) if ex.failed]


def may_explain(ex: RankExit) -> bool:
    """Whether this exit can be a first error (a SIGTERM from a cancel or a torchrun teardown cannot)."""
    return ex.failed and may_be_cause(_as_evidence(ex, frozenset()))


def _as_evidence(ex: RankExit, explained: AbstractSet[str | None]) -> Evidence:
    if ex.signal == SIGKILL:
        pending = "" if ex.node in explained else "; kernel log pending"
        what = f"rank {ex.rank} killed by SIGKILL: OOM killer or operator{pending}"
    elif ex.signal is not None:
        what = f"rank {ex.rank} killed by signal {ex.signal}"
    else:
        what = f"rank {ex.rank} exited with status {ex.exit_code}"
    data = EvidenceData(
        category=C.PROCESS_EXITED,
        summary=what,
        origin="lifecycle: rank_exited",
        exit_code=ex.exit_code,
        signal=ex.signal,
        pid=ex.pid,
    )
    return Evidence(data=data, time=ex.time, node=ex.node, rank=ex.rank, id=ex.id)


def settlement(story: AttemptStory) -> Settlement:
    """Whether the attempt's finding is settled, and what it still waits for."""
    waiting = waiting_for(story)
    if not waiting:
        return Settlement(settled=True, reason="every rank and node of the attempt is accounted for", waiting_for=())
    if story.window_ended:
        window = f"{story.window.total_seconds():g} s"
        reason = f"the settle window ({window}) ended; never arrived: {'; '.join(waiting)}"
        return Settlement(settled=True, reason=reason, waiting_for=waiting)
    return Settlement(settled=False, reason="waiting for " + "; ".join(waiting), waiting_for=waiting)


def waiting_for(story: AttemptStory) -> tuple[str, ...]:
    """What the attempt's story still lacks: a kernel log, a node that said nothing, exits, evidence in flight."""
    if not story.world.ranks:
        return ("the attempt's placement",)
    heard_nodes = {e.node for e in story.evidence if e.node} | {x.node for x in story.exits.values() if x.node}
    explained = {e.node for e in story.evidence if e.category in KERNEL_CATEGORIES and e.node}
    waiting: list[str] = []
    no_exit: dict[str, list[int]] = defaultdict(list)
    for rank, node in sorted(story.world.ranks.items()):
        if rank not in story.exits:
            no_exit[node or "an unknown node"].append(rank)
    for node in sorted(story.world.all_nodes - heard_nodes):
        waiting.append(f"{node}: silent (no rank exit, no evidence)")
        no_exit.pop(node, None)
    for node, ranks in sorted(no_exit.items()):
        waiting.append(f"the exit of rank{'s' if len(ranks) > 1 else ''} {_listed(ranks)} on {node}")
    for ex in sorted(story.exits.values(), key=lambda x: x.rank):
        if ex.signal in KERNEL_SIGNALS and ex.node not in explained:
            name = signal.Signals(ex.signal).name
            waiting.append(f"the kernel log of {ex.node} (rank {ex.rank} was killed by {name})")
        missing = (ex.evidence or 0) - story.heard.get(ex.rank, 0)
        if missing > 0:
            waiting.append(
                f"{missing} evidence item{'s' if missing > 1 else ''} rank {ex.rank} reported before its exit"
            )
    return tuple(waiting)


def settled_finding(story: AttemptStory, *, version: int = 1) -> JobFindingData:
    """Elect the first error over the evidence and the failed exits, and say whether it is settled."""
    finding = elect_first_error(
        [*story.evidence, *exit_evidence(story)],
        world=story.world,
        version=version,
        ended_at=story.ended_at,
        cause_window=story.cause_window,
    )
    settled = settlement(story)
    return finding.model_copy(
        update={"settled": settled.settled, "settle_reason": settled.reason, "waiting_for": settled.waiting_for}
    )


_LISTED = 8


def _listed(ranks: Sequence[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) <= _LISTED else f"{ranks[0]}-{ranks[-1]} ({len(ranks)} ranks)"
