"""Slow ranks and degraded links: the faults that crash nothing, read from per-rank step timings. Pure.

A slow rank fails no collective: every rank waits for it, so every rank's step grows and nothing errs. What
tells it apart is where each rank spends its step. A rank reports, per training step, the time it
computed and the time it waited inside collectives; the rank that arrives last at a collective waits least.

- **Detection** is a one-sided CUSUM on the job's step time relative to its own baseline (the median of
  the first `warmup` steps): each step adds how far it is above the baseline beyond half the smallest
  shift worth reporting, and the sum is cut back at zero. An alarm needs the sum above a threshold, so
  one slow step (a checkpoint, a garbage collection) is never a shift: each step's excess is clipped, and
  only several slow steps in a row reach the threshold. The onset is the step after the sum last stood at
  zero, and the slowdown the median excess since then.
- **Attribution** reads the steps since the onset beside the baseline:
  - a **compute straggler** (host lane): one rank's own compute time rose, and it is the last to arrive
    at most collectives (the vote);
  - a **degraded link** (network lane): no rank computes longer, the waits rose; when the rise is
    concentrated on the ranks of one node (or leaf) that node is named, else the job's collective path;
  - **imbalance** (algorithm lane): no change at all, but one rank computes longer than its peers from the
    first step on and holds the others back: the work is split unevenly.
- **Cost**, as a what-if: the seconds the job lost against its baseline since the onset (the job as it
  would have run had no rank been slow), and the GPU-hours that held.

CUSUM rather than Bayesian online change-point detection: it is a few additions per step per job, its two
parameters read as "the smallest slowdown worth a page" and "how sure", and `bench/stragglers.py` measures
what it detects and how fast.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from lanes_contract.events import Lane

DEFAULT_WARMUP = 30
"""Steps read as the job's baseline before any shift is looked for."""
DEFAULT_MIN_SHIFT = 0.05
"""The smallest relative slowdown worth a finding (5%); a shift of half of it is the CUSUM's allowance."""
_THRESHOLD_SHIFTS = 6
"""How many minimum shifts the CUSUM must gather before it alarms (with each step's excess clipped to
three of them, at least three slow steps in a row: one checkpoint step is never a slowdown)."""
_CLIP_SHIFTS = 3
_VOTE_MAJORITY = 0.5
_CONCENTRATION = 1.5
"""How much more a node's ranks' wait must have risen than the others' for the link to be named there."""


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


@dataclass
class StepShift:
    """Online one-sided CUSUM over a job's step times (one `observe` per completed step)."""

    warmup: int = DEFAULT_WARMUP
    min_shift: float = DEFAULT_MIN_SHIFT
    baseline: float | None = None
    onset: int | None = None
    """The step the current shift began at, once the detector alarmed."""
    _warm: list[float] = field(default_factory=list)
    _sum: float = 0.0
    _since: int | None = None

    def observe(self, step: int, seconds: float) -> bool:
        """Take one step's time; True when this step makes the shift certain (the alarm, raised once)."""
        if self.baseline is None:
            self._warm.append(seconds)
            if len(self._warm) >= self.warmup:
                self.baseline = statistics.median(self._warm)
            return False
        if self.onset is not None or self.baseline <= 0:
            return False
        excess = min(seconds / self.baseline - 1, _CLIP_SHIFTS * self.min_shift)
        if self._sum == 0:
            self._since = step
        self._sum = max(0.0, self._sum + excess - self.min_shift / 2)
        if self._sum == 0:
            self._since = None
            return False
        if self._sum >= _THRESHOLD_SHIFTS * self.min_shift:
            self.onset = self._since
            return True
        return False


@dataclass(frozen=True)
class Slowdown:
    """A finding about a slow job: what kind, whose, how much, since when and what it cost."""

    kind: SlowClass
    lane: Lane
    onset_step: int
    slowdown: float
    """Relative step-time increase since the onset (0.38: +38%); for imbalance, the rank's excess compute."""
    rank: int | None = None
    node: str | None = None
    lost_s: float = 0.0
    """Seconds the job lost against its baseline since the onset (the what-if: no rank slow)."""
    votes: float = 0.0
    """Share of the collectives since the onset at which the named rank arrived last."""

    def gpu_hours(self, gpus: int) -> float:
        """GPU-hours the slowness held, on a job of `gpus` GPUs."""
        return self.lost_s * gpus / 3600

    def summary(self) -> str:
        """One line for the timeline: the rank or link, the class and the slowdown."""
        who = f"rank {self.rank}" if self.rank is not None else (self.node or "the job's collective path")
        since = "from the first step" if self.kind is SlowClass.IMBALANCE else f"since step {self.onset_step:,}"
        what = {
            SlowClass.COMPUTE_STRAGGLER: "step time",
            SlowClass.DEGRADED_LINK: "step time (collective wait)",
            SlowClass.IMBALANCE: "compute time over its peers",
        }[self.kind]
        return f"{who}: {what} +{self.slowdown:.0%} {since} ({self.kind.value})"


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


def detect(
    steps: Sequence[RankStep],
    *,
    nodes: Mapping[int, str] | None = None,
    warmup: int = DEFAULT_WARMUP,
    min_shift: float = DEFAULT_MIN_SHIFT,
) -> Slowdown | None:
    """Read a job's per-rank step timings: a slowdown with its class, rank or link, onset and cost, or None."""
    times = step_times(steps)
    ordered = sorted(times)
    detector = StepShift(warmup=warmup, min_shift=min_shift)
    for step in ordered:
        if detector.observe(step, times[step]):
            break
    by_rank = _by_rank(steps)
    baseline_steps = set(ordered[:warmup])
    if detector.onset is None or detector.baseline is None:
        return _imbalance(steps, by_rank, nodes or {}, min_shift)
    onset, baseline = detector.onset, detector.baseline
    after = {step for step in ordered if step >= onset}
    slowdown = statistics.median(times[s] / baseline - 1 for s in after)
    lost = sum(max(times[s] - baseline, 0.0) for s in after)
    compute_rise = {
        rank: _rise([s.compute_s for s in rs if s.step in baseline_steps], [s.compute_s for s in rs if s.step in after])
        for rank, rs in by_rank.items()
    }
    votes = Counter(rank for step, rank in last_to_arrive(steps).items() if step in after)
    straggler, count = votes.most_common(1)[0] if votes else (None, 0)
    share = count / max(len(after), 1)
    if straggler is not None and compute_rise.get(straggler, 0.0) >= min_shift and share >= _VOTE_MAJORITY:
        return Slowdown(
            SlowClass.COMPUTE_STRAGGLER,
            LANE_OF[SlowClass.COMPUTE_STRAGGLER],
            onset,
            slowdown,
            rank=straggler,
            node=(nodes or {}).get(straggler),
            lost_s=lost,
            votes=share,
        )
    wait_rise = {
        rank: statistics.median(s.wait_s for s in rs if s.step in after)
        - statistics.median(s.wait_s for s in rs if s.step in baseline_steps)
        for rank, rs in by_rank.items()
    }
    return Slowdown(
        SlowClass.DEGRADED_LINK,
        LANE_OF[SlowClass.DEGRADED_LINK],
        onset,
        slowdown,
        node=_concentrated(wait_rise, nodes or {}),
        lost_s=lost,
    )


def _by_rank(steps: Sequence[RankStep]) -> dict[int, list[RankStep]]:
    ranks: dict[int, list[RankStep]] = {}
    for s in steps:
        ranks.setdefault(s.rank, []).append(s)
    return ranks


def _rise(before: Sequence[float], after: Sequence[float]) -> float:
    """Relative rise of the median from `before` to `after` (0 when either is empty or zero)."""
    if not before or not after:
        return 0.0
    base = statistics.median(before)
    return statistics.median(after) / base - 1 if base > 0 else 0.0


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
    others = [rise for node, rise in means.items() if node != worst]
    rest = max(statistics.fmean(others), 0.0)
    return worst if means[worst] > 0 and means[worst] >= _CONCENTRATION * rest else None


def _imbalance(
    steps: Sequence[RankStep], by_rank: Mapping[int, list[RankStep]], nodes: Mapping[int, str], min_shift: float
) -> Slowdown | None:
    """No shift over time: a rank that computed longer than its peers from the start and held them back."""
    if len(by_rank) < 2:  # noqa: PLR2004 - imbalance needs peers
        return None
    compute = {rank: statistics.median(s.compute_s for s in rs) for rank, rs in by_rank.items()}
    slowest = max(compute, key=lambda rank: (compute[rank], -rank))
    peers = statistics.median(c for rank, c in compute.items() if rank != slowest)
    excess = compute[slowest] / peers - 1 if peers > 0 else 0.0
    votes = Counter(last_to_arrive(steps).values())
    share = votes[slowest] / max(sum(votes.values()), 1)
    if excess < min_shift or share < _VOTE_MAJORITY:
        return None
    first = min(s.step for s in steps)
    lost = (compute[slowest] - peers) * len(step_times(steps))  # every step waited for it that much
    kind = SlowClass.IMBALANCE
    return Slowdown(kind, LANE_OF[kind], first, excess, rank=slowest, node=nodes.get(slowest), lost_s=lost, votes=share)
