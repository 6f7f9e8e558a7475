"""Slow ranks and degraded links from per-rank step timings (telemetry's pure straggler core)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lanes_contract.events import Lane
from lanes_telemetry.domain.stragglers import RankStep, SlowClass, StepShift, detect, last_to_arrive, step_times

NODES = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}


def _job(
    steps: int = 120,
    *,
    slow_rank: int | None = None,
    compute_from: int | None = None,
    factor: float = 1.0,
    link_from: int | None = None,
    link_extra_s: float = 0.0,
    behind: frozenset[int] = frozenset(),
    spikes: frozenset[int] = frozenset(),
) -> list[RankStep]:
    """Four ranks computing 1 s (a +-1% wobble by rank and step) then meeting in an all-reduce of 0.25 s."""
    out = []
    for step in range(steps):
        compute = {}
        for rank in range(4):
            c = 1.0 + 0.01 * (((step * 7 + rank * 3) % 5) - 2) / 2
            if rank == slow_rank and (compute_from is None or step >= compute_from):
                c *= factor
            if step in spikes:
                c *= 3  # a checkpoint step
            compute[rank] = c
        arrival = max(compute.values())
        for rank, c in compute.items():
            wait = arrival - c + 0.25
            if link_from is not None and step >= link_from:
                wait += link_extra_s * (2 if rank in behind else 1)
            out.append(RankStep(rank, step, c, wait))
    return out


def test_a_steady_job_with_a_checkpoint_step_now_and_then_is_not_slow():
    assert detect(_job(300, spikes=frozenset({49, 99, 149, 199, 249})), nodes=NODES) is None


def test_a_rank_whose_compute_rose_is_named_as_the_straggler_with_onset_slowdown_and_cost():
    found = detect(_job(slow_rank=2, compute_from=60, factor=1.4), nodes=NODES)
    assert found is not None
    assert (found.kind, found.lane, found.rank, found.node) == (SlowClass.COMPUTE_STRAGGLER, Lane.HOST, 2, "node-b")
    assert 58 <= found.onset_step <= 61
    assert 0.25 < found.slowdown < 0.4  # a 40% slower compute is about +32% on a step that also all-reduces
    assert found.votes == 1.0
    assert found.lost_s > 0
    assert found.gpu_hours(32) == found.lost_s * 32 / 3600
    assert found.summary().startswith(f"rank 2: step time +{found.slowdown:.0%} since step {found.onset_step}")


def test_waits_that_rose_while_no_rank_computes_longer_are_a_degraded_link():
    uniform = detect(_job(link_from=50, link_extra_s=0.4), nodes=NODES)
    assert uniform is not None
    assert (uniform.kind, uniform.lane, uniform.rank, uniform.node) == (
        SlowClass.DEGRADED_LINK, Lane.NETWORK, None, None,
    )  # fmt: skip
    assert "the job's collective path" in uniform.summary()
    behind_b = detect(_job(link_from=50, link_extra_s=0.4, behind=frozenset({2, 3})), nodes=NODES)
    assert behind_b is not None
    assert (behind_b.kind, behind_b.node) == (SlowClass.DEGRADED_LINK, "node-b")


def test_a_rank_slower_from_the_first_step_is_imbalance_in_the_algorithm_lane():
    found = detect(_job(slow_rank=1, factor=1.2), nodes=NODES)
    assert found is not None
    assert (found.kind, found.lane, found.rank, found.onset_step) == (SlowClass.IMBALANCE, Lane.ALGORITHM, 1, 0)
    assert 0.15 < found.slowdown < 0.25
    assert "from the first step" in found.summary()


def test_the_last_to_arrive_is_the_rank_that_waited_least_and_a_step_lasts_as_long_as_its_slowest_rank():
    steps = _job(3, slow_rank=3, factor=1.5)
    assert set(last_to_arrive(steps).values()) == {3}
    assert step_times(steps) == {s: max(r.total_s for r in steps if r.step == s) for s in range(3)}


@settings(max_examples=200)
@given(
    st.lists(st.floats(min_value=0.97, max_value=1.03), min_size=60, max_size=400),
    st.sets(st.integers(min_value=30, max_value=399), max_size=20),
)
def test_isolated_slow_steps_never_raise_an_alarm(wobble: list[float], spiky: set[int]):
    # Any number of single slow steps (checkpoints, collections), as long as no two are adjacent.
    lone = {s for s in spiky if s - 1 not in spiky and s + 1 not in spiky}
    detector = StepShift()
    alarms = [detector.observe(step, w * (5.0 if step in lone else 1.0)) for step, w in enumerate(wobble)]
    assert not any(alarms)


@settings(max_examples=100)
@given(st.floats(min_value=0.1, max_value=2.0), st.integers(min_value=30, max_value=200))
def test_a_sustained_shift_of_ten_percent_or_more_is_found_within_twenty_steps(shift: float, onset: int):
    detector = StepShift()
    fired = next(
        (step for step in range(onset + 200) if detector.observe(step, 1.0 + (shift if step >= onset else 0.0))),
        None,
    )
    assert fired is not None
    assert onset <= fired < onset + 20
    assert detector.onset == onset
