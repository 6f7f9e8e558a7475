"""Slow ranks and degraded links from per-rank step timings (telemetry's pure straggler core)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lanes_contract.events import Lane
from lanes_telemetry.domain.stragglers import DEFAULT_WARMUP, RankStep, SlowClass, detect, last_to_arrive, step_times

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
    assert abs(found.onset_step - 60) <= 8  # the first block of 8 steps in which the others waited for it
    assert 0.35 < found.slowdown < 0.45  # its compute, 40% longer
    assert found.votes == 1.0
    assert found.lost_s > 0
    assert found.gpu_hours(32) == found.lost_s * 32 / 3600
    assert found.summary() == (
        f"rank 2: compute +{found.slowdown:.0%}, the others wait for it since step {found.onset_step} "
        "(compute_straggler)"
    )


def test_a_straggler_the_others_slack_absorbs_is_still_named():
    # Rank 3 computes 15% longer but the others still wait longer in their all-reduce (a real drill showed
    # it: the job's step barely moved, rank 3 became the one everybody waits for).
    steps = [
        RankStep(s.rank, s.step, s.compute_s * (1.15 if s.rank == 3 and s.step >= 40 else 1.0), 0.3)
        if s.rank != 3 or s.step < 40
        else RankStep(3, s.step, s.compute_s * 1.15, 0.01)
        for s in _job(120)
    ]
    found = detect(steps, nodes=NODES)
    assert found is not None
    assert (found.kind, found.rank) == (SlowClass.COMPUTE_STRAGGLER, 3)


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


def test_a_job_whose_every_rank_computes_slower_names_no_rank_and_no_link():
    # A shared host or a slow data source: the whole job slowed, nobody waits for anybody in particular.
    steps = [RankStep(s.rank, s.step, s.compute_s * (1.3 if s.step >= 50 else 1.0), s.wait_s) for s in _job()]
    assert detect(steps, nodes=NODES) is None


def test_a_rank_slower_from_the_first_step_is_imbalance_in_the_algorithm_lane():
    found = detect(_job(slow_rank=1, factor=1.2), nodes=NODES)
    assert found is not None
    assert (found.kind, found.lane, found.rank, found.onset_step) == (SlowClass.IMBALANCE, Lane.ALGORITHM, 1, 0)
    assert 0.15 < found.slowdown < 0.25
    assert "from the first steps" in found.summary()


def test_the_last_to_arrive_is_the_rank_that_waited_least_and_a_step_lasts_as_long_as_its_slowest_rank():
    steps = _job(3, slow_rank=3, factor=1.5)
    assert set(last_to_arrive(steps).values()) == {3}
    assert step_times(steps) == {s: max(r.total_s for r in steps if r.step == s) for s in range(3)}


@settings(max_examples=100, deadline=None)
@given(st.sets(st.integers(min_value=0, max_value=299), max_size=40), st.integers(min_value=2, max_value=4))
def test_isolated_slow_steps_never_raise_an_alarm(spiky: set[int], factor: int):
    # Any number of lone slow steps (checkpoints, collections), as long as no two are adjacent.
    lone = frozenset(s for s in spiky if s - 1 not in spiky and s + 1 not in spiky)
    steps = [RankStep(s.rank, s.step, s.compute_s * (factor if s.step in lone else 1), s.wait_s) for s in _job(300)]
    assert detect(steps, nodes=NODES) is None


@settings(max_examples=30, deadline=None)
@given(st.floats(min_value=0.25, max_value=2.0), st.integers(min_value=30, max_value=120), st.integers(0, 3))
def test_a_rank_a_quarter_slower_or_more_is_named_within_twenty_four_steps(factor: float, onset: int, rank: int):
    steps = _job(onset + 24, slow_rank=rank, compute_from=onset, factor=1 + factor)
    found = detect(steps, nodes=NODES)
    assert found is not None
    assert (found.kind, found.rank) == (SlowClass.COMPUTE_STRAGGLER, rank)


def test_a_straggler_is_named_against_its_peers_when_the_baseline_was_taken_on_a_busier_host() -> None:
    # Every rank computes 40% longer during the baseline (a busy host), then rank 2 alone from step 60: against
    # its own baseline it did not slow, against its peers it computes 40% longer and they wait for it.
    steps = []
    for s in _job(200, slow_rank=2, compute_from=60, factor=1.4):
        busy = 1.4 if s.step < DEFAULT_WARMUP else 1.0
        steps.append(RankStep(s.rank, s.step, s.compute_s * busy, s.wait_s * busy))
    found = detect(steps, nodes=NODES)
    assert found is not None
    assert (found.kind, found.lane, found.rank, found.node) == (SlowClass.COMPUTE_STRAGGLER, Lane.HOST, 2, "node-b")
    assert 0.35 < found.slowdown < 0.45
