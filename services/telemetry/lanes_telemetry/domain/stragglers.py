"""Slow ranks and degraded links: the faults that crash nothing, read from per-rank step timings. Pure.

A slow rank fails no collective: every rank waits for it, and nothing errs. What tells it apart is where
each rank spends its step. A rank reports, per training step, the time it computed and the time it waited
inside collectives; the rank that arrives last at a collective waits least.

Real step times are noisy (a shared host, a garbage collection, a checkpoint), so nothing here reads one
step: every signal is the **median of a block** of steps against the attempt's **baseline** (its first
`warmup` steps), and the smallest shift worth a finding grows with the noise the baseline showed.

- **A straggler** is a rank that arrives last at most collectives of the recent window while it did not
  before, and whose own compute rose against its own baseline (host lane). It is named even while the
  others' slack absorbs it (the job's step barely moves): from then on it is the job's critical path.
- **A job that slowed** is found by a one-sided CUSUM over the block medians of the job's step time: each
  block adds how far it is above the baseline beyond half the smallest shift worth a finding (clipped, so
  one bad block is never a slowdown) and the sum is cut back at zero; an alarm needs the sum above a
  threshold. The onset is the first step of the run of blocks that raised it. Attributed then:
  - waits that rose (by at least half the step's rise) while no single rank holds the others back: a
    **degraded link** (network lane), its node named when the rise sits on one node's ranks (in a ring every
    rank waits alike, so often only the job's collective path can be named);
  - every rank computing slower: the whole job slowed (a shared host, a data source); that names no rank
    and no link, and nothing is said.
- **Imbalance** (algorithm lane): a rank that computed longer than its peers and arrived last from the
  first steps on: the work is split unevenly.

Each finding carries what it cost, as a what-if: the seconds the job lost against its baseline since the
onset, and the GPU-hours that held.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from lanes_contract.events import Lane

DEFAULT_WARMUP = 30
"""Steps read as the attempt's baseline before any change is looked for."""
DEFAULT_MIN_SHIFT = 0.05
"""The smallest relative slowdown worth a finding on a quiet job (5%); a noisy baseline raises it."""
BLOCK = 8
"""Steps per block: each signal is a block's median, so a burst of a few bad steps moves nothing."""
RECENT = 32
"""Steps of the recent window in which a straggler must be the one the others wait for."""
_NOISE_SHIFTS = 3.0
"""A shift must stand this many noise units (the baseline's spread of a block median) above the baseline."""
_THRESHOLD_SHIFTS = 4
"""How many minimum shifts the CUSUM must gather: with each block's excess clipped to three of them, at
least two slow blocks in a row."""
_CLIP_SHIFTS = 3
_MAJORITY = 0.6
"""Share of the window's collectives a rank must arrive last at to be the one holding the others back (at
least 1.5 times its fair share: three in four of a two-rank job's)."""
_LINK_SHARE = 0.5
"""How much of the step's rise the collective waits must explain for the slowdown to be a degraded link."""
_CONCENTRATION = 1.5
"""How much more a node's ranks' wait must have risen than the others' for the link to be named there."""
_MAD_TO_SIGMA = 1.4826
_NOISE_FLOOR = 0.01


class SlowClass(StrEnum):
    """What kind of slowness the timings show."""

    COMPUTE_STRAGGLER = "compute_straggler"
    DEGRADED_LINK = "degraded_link"
    IMBALANCE = "imbalance"


LANE_OF = {
    SlowClass.COMPUTE_STRAGGLER: Lane.HOST,
    SlowClass.DEGRADED_LINK: Lane.NETWORK,
    SlowClass.IMBALANCE: Lane.ALGORITHM,
}


@dataclass(frozen=True)
class RankStep:
    """One rank's time in one training step: computing, and waiting inside its collectives."""

    rank: int
    step: int
    compute_s: float
    wait_s: float

    @property
    def total_s(self) -> float:
        """The step as this rank lived it."""
        return self.compute_s + self.wait_s


@dataclass(frozen=True)
class Slowdown:
    """A finding about a slow job: what kind, whose, how much, since when and what it cost."""

    kind: SlowClass
    lane: Lane
    onset_step: int
    slowdown: float
    """How much slower (0.38: +38%): the rank's compute (a straggler, imbalance: over its peers) or the
    job's step (a degraded link)."""
    rank: int | None = None
    node: str | None = None
    lost_s: float = 0.0
    """Seconds the job lost against its baseline since the onset (the what-if: no rank slow)."""
    votes: float = 0.0
    """Share of the recent collectives at which the named rank arrived last."""

    def gpu_hours(self, gpus: int) -> float:
        """GPU-hours the slowness held, on a job of `gpus` GPUs."""
        return self.lost_s * gpus / 3600

    def summary(self) -> str:
        """One line for the timeline: the rank or link, the class and the slowdown."""
        who = f"rank {self.rank}" if self.rank is not None else (self.node or "the job's collective path")
        since = "from the first steps" if self.kind is SlowClass.IMBALANCE else f"since step {self.onset_step:,}"
        what = {
            SlowClass.COMPUTE_STRAGGLER: f"compute +{self.slowdown:.0%}, the others wait for it",
            SlowClass.DEGRADED_LINK: f"step time +{self.slowdown:.0%} in collective waits",
            SlowClass.IMBALANCE: f"compute +{self.slowdown:.0%} over its peers, the others wait for it",
        }[self.kind]
        return f"{who}: {what} {since} ({self.kind.value})"


def step_times(steps: Sequence[RankStep]) -> dict[int, float]:
    """The job's time per step: the longest any rank lived it (the step ends when its last rank does)."""
    times: dict[int, float] = {}
    for s in steps:
        times[s.step] = max(times.get(s.step, 0.0), s.total_s)
    return times


def last_to_arrive(steps: Sequence[RankStep]) -> dict[int, int]:
    """Per step, the rank that waited least in its collectives: the one the others waited for."""
    last: dict[int, RankStep] = {}
    for s in steps:
        if s.step not in last or s.wait_s < last[s.step].wait_s:
            last[s.step] = s
    return {step: s.rank for step, s in last.items()}


@dataclass(frozen=True)
class _Job:
    """One attempt's timings, ordered, with its baseline read once."""

    ordered: list[int]
    times: dict[int, float]
    ranks: dict[int, dict[int, RankStep]]
    last: dict[int, int]
    baseline: list[int]
    nodes: Mapping[int, str]

    @property
    def later(self) -> list[int]:
        return self.ordered[len(self.baseline) :]


def detect(
    steps: Sequence[RankStep],
    *,
    nodes: Mapping[int, str] | None = None,
    warmup: int = DEFAULT_WARMUP,
    min_shift: float = DEFAULT_MIN_SHIFT,
) -> Slowdown | None:
    """Read an attempt's per-rank step timings: a slowdown with its class, rank or link, onset and cost, or None."""
    times = step_times(steps)
    ordered = sorted(times)
    ranks: dict[int, dict[int, RankStep]] = {}
    for s in steps:
        ranks.setdefault(s.rank, {})[s.step] = s
    if len(ordered) < warmup + BLOCK or len(ranks) < 2:  # noqa: PLR2004 - nobody waits for anybody alone
        return None
    job = _Job(ordered, times, ranks, last_to_arrive(steps), ordered[:warmup], nodes or {})
    return _straggler(job, min_shift) or _job_shift(job, min_shift) or _imbalance(job, min_shift)


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def _shift_worth(values: Sequence[float], min_shift: float, block: int) -> float:
    """The smallest relative shift of a `block`-step median that stands out of this baseline's noise."""
    centre = _median(values)
    if centre <= 0:
        return min_shift
    spread = _MAD_TO_SIGMA * _median([abs(v - centre) for v in values]) / centre
    return max(min_shift, _NOISE_SHIFTS * max(spread, _NOISE_FLOOR) / math.sqrt(block))


def _lost(job: _Job, since: int) -> float:
    base = _median([job.times[s] for s in job.baseline])
    return sum(max(job.times[s] - base, 0.0) for s in job.ordered if s >= since)


def _straggler(job: _Job, min_shift: float) -> Slowdown | None:
    """A rank the others now wait for (they did not in the baseline), whose own compute rose."""
    recent = job.later[-RECENT:]
    if len(recent) < RECENT // 2:
        return None
    votes = Counter(job.last[s] for s in recent)
    rank, count = votes.most_common(1)[0]
    share = count / len(recent)
    before = Counter(job.last[s] for s in job.baseline)[rank] / len(job.baseline)
    majority = max(_MAJORITY, 1.5 / len(job.ranks))
    if share < majority or before >= majority:
        return None  # nobody stands out, or this rank always did (imbalance, read below)
    mine = job.ranks[rank]
    base = [mine[s].compute_s for s in job.baseline if s in mine]
    now = _median([mine[s].compute_s for s in recent if s in mine])
    rise = now / _median(base) - 1 if base else 0.0
    # Its compute against its peers' over the same steps, too: a baseline taken while the host was busier (a
    # shared machine, the job's own start-up) hides a rise against itself, never one against the others.
    peers = _median([_median([c[s].compute_s for s in recent if s in c]) for r, c in job.ranks.items() if r != rank])
    over_peers = now / peers - 1 if peers > 0 else 0.0
    rise = max(rise, over_peers)
    if rise < _shift_worth(base, min_shift, len(recent)):
        return None
    onset = _onset(job, rank)
    kind = SlowClass.COMPUTE_STRAGGLER
    return Slowdown(
        kind, LANE_OF[kind], onset, rise, rank=rank, node=job.nodes.get(rank), lost_s=_lost(job, onset), votes=share
    )


def _onset(job: _Job, rank: int) -> int:
    """Where `rank` began to hold the others back: the first step of the run of blocks it was last in."""
    blocks = [job.later[i : i + BLOCK] for i in range(0, len(job.later), BLOCK)]
    onset = job.later[0]
    held = False
    for block in blocks:
        mostly = sum(job.last[s] == rank for s in block) / len(block) >= _MAJORITY
        if mostly and not held:
            onset, held = block[0], True
        elif not mostly:
            held = False
    return onset


def _job_shift(job: _Job, min_shift: float) -> Slowdown | None:
    """A CUSUM over block medians of the step time; a shift the waits explain is a degraded link."""
    base_times = [job.times[s] for s in job.baseline]
    baseline = _median(base_times)
    shift = _shift_worth(base_times, min_shift, BLOCK)
    total = 0.0
    since: int | None = None
    onset: int | None = None
    for i in range(0, len(job.later) - BLOCK + 1, BLOCK):
        block = job.later[i : i + BLOCK]
        excess = min(_median([job.times[s] for s in block]) / baseline - 1, _CLIP_SHIFTS * shift)
        if total == 0:
            since = block[0]
        total = max(0.0, total + excess - shift / 2)
        if total >= _THRESHOLD_SHIFTS * shift:
            onset = since
            break
    if onset is None:
        return None
    after = [s for s in job.later if s >= onset]
    slowdown = _median([job.times[s] for s in after]) / baseline - 1
    wait_rise = {
        rank: _median([mine[s].wait_s for s in after if s in mine])
        - _median([mine[s].wait_s for s in job.baseline if s in mine])
        for rank, mine in job.ranks.items()
    }
    if _median(list(wait_rise.values())) < _LINK_SHARE * slowdown * baseline:
        # Every rank computes slower and none waits much longer: the whole job slowed (a shared host, a data
        # source), which names no rank and no link. Said nothing rather than guessed.
        return None
    kind = SlowClass.DEGRADED_LINK
    node = _concentrated(wait_rise, job.nodes)
    return Slowdown(kind, LANE_OF[kind], onset, slowdown, node=node, lost_s=_lost(job, onset))


def _concentrated(wait_rise: Mapping[int, float], nodes: Mapping[int, str]) -> str | None:
    """The node whose ranks' wait rose clearly more than everyone else's, if one did."""
    per_node: dict[str, list[float]] = {}
    for rank, rise in wait_rise.items():
        if rank in nodes:
            per_node.setdefault(nodes[rank], []).append(rise)
    if len(per_node) < 2:  # noqa: PLR2004 - a node stands out only beside another
        return None
    means = {node: statistics.fmean(rises) for node, rises in per_node.items()}
    worst = max(means, key=lambda node: (means[node], node))
    rest = max(statistics.fmean([rise for node, rise in means.items() if node != worst]), 0.0)
    return worst if means[worst] > 0 and means[worst] >= _CONCENTRATION * rest else None


def _imbalance(job: _Job, min_shift: float) -> Slowdown | None:
    """No change over time: a rank that computed longer than its peers from the first steps and held them back."""
    votes = Counter(job.last[s] for s in job.baseline)
    rank, count = votes.most_common(1)[0]
    share = count / len(job.baseline)
    if share < max(_MAJORITY, 1.5 / len(job.ranks)):
        return None
    compute = {r: _median([mine[s].compute_s for s in job.ordered if s in mine]) for r, mine in job.ranks.items()}
    peers = _median([c for r, c in compute.items() if r != rank])
    excess = compute[rank] / peers - 1 if peers > 0 else 0.0
    if excess < min_shift:
        return None
    lost = (compute[rank] - peers) * len(job.ordered)  # every step waited for it that much
    kind = SlowClass.IMBALANCE
    return Slowdown(
        kind, LANE_OF[kind], job.ordered[0], excess, rank=rank, node=job.nodes.get(rank), lost_s=lost, votes=share
    )
