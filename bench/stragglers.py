"""Slow-rank and degraded-link detection on simulated per-rank step timings (issue 42's core, measured).

    uv run python bench/stragglers.py [--seeds N]

A job of 8 ranks on 4 nodes runs 1,000 steps: each rank computes for about 1 s (2% noise), then all meet in
an all-reduce of about 0.25 s, started when the last rank arrives; every 100th step also writes a checkpoint
(3x the step), the kind of one-off spike that must never read as a slowdown. A fault begins at step 300:
- `compute_straggler`: one rank computes slower by the given factor;
- `degraded_link`: the all-reduce slows so that the step slows by the factor (a ring: every rank waits
  alike, so only the class can be right, not the node);
- `imbalance`: one rank computes longer from the first step.

Printed (one JSON object, medians over seeds): `detection_steps` (steps from the onset until reading the
steps that arrived so far names the straggler, at 25%), `detection_steps_by_slowdown` (10%, 25%, 50%; null
where never detected), `false_alarms` (clean runs in which any reading, every 25 steps, named a slowdown),
`class_accuracy` (the right class over every fault kind and size) and `hook_overhead` (what the torch
timing hook that feeds any job costs a step of a sub-millisecond loop, the worst case, from
`bench/timing_hook.py`; null without torch). The baseline beside it is the naive rule a person applies by
hand: alarm when a step is 10% over the first 30 steps' median; its false alarms on the same clean runs are
printed as `naive_false_alarms`.

The timings are simulated, so this measures the detector against its model of a job, not a real job.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
from typing import Any

from lanes_telemetry.domain.stragglers import RankStep, SlowClass, detect, step_times

RANKS, RANKS_PER_NODE, STEPS, ONSET, SLOW_RANK = 8, 2, 1000, 300, 5
COMPUTE_S, ALLREDUCE_S, NOISE = 1.0, 0.25, 0.02
CHECKPOINT_EVERY, CHECKPOINT_FACTOR = 100, 3.0
NODES = {rank: f"node-{rank // RANKS_PER_NODE}" for rank in range(RANKS)}
SLOWDOWNS = (0.1, 0.25, 0.5)


def simulate(seed: int, kind: SlowClass | None, slowdown: float, slow_rank: int = SLOW_RANK) -> list[RankStep]:
    """One job's per-rank timings under one fault (None: a clean run)."""
    rng = random.Random(seed)  # noqa: S311 - simulated noise, seeded to be repeatable
    steps: list[RankStep] = []
    for step in range(STEPS):
        faulty = step >= ONSET
        compute = {}
        for rank in range(RANKS):
            c = COMPUTE_S * (1 + rng.gauss(0, NOISE))
            if rank == slow_rank and ((kind is SlowClass.COMPUTE_STRAGGLER and faulty) or kind is SlowClass.IMBALANCE):
                c *= 1 + slowdown
            if step % CHECKPOINT_EVERY == CHECKPOINT_EVERY - 1:
                c *= CHECKPOINT_FACTOR
            compute[rank] = c
        allreduce = ALLREDUCE_S * (1 + rng.gauss(0, NOISE))
        if kind is SlowClass.DEGRADED_LINK and faulty:
            allreduce += slowdown * (COMPUTE_S + ALLREDUCE_S)
        arrival = max(compute.values())
        steps.extend(RankStep(rank, step, c, arrival - c + allreduce) for rank, c in compute.items())
    return steps


def _naive_alarms(steps: list[RankStep]) -> int:
    times = step_times(steps)
    baseline = statistics.median(times[s] for s in sorted(times)[:30])
    return sum(1 for s in sorted(times)[30:] if times[s] > 1.1 * baseline)


def _detection_steps(seed: int, slowdown: float) -> int | None:
    """Steps from the onset until telemetry, reading what has arrived so far, names the straggler."""
    steps = simulate(seed, SlowClass.COMPUTE_STRAGGLER, slowdown)
    for seen in range(ONSET, ONSET + 200):
        found = detect([s for s in steps if s.step <= seen], nodes=NODES)
        if found is not None:
            named = found.kind is SlowClass.COMPUTE_STRAGGLER and found.rank == SLOW_RANK
            return seen - ONSET + 1 if named else None
    return None


def _false_alarms(steps: list[RankStep]) -> int:
    """Whether reading a clean run as it arrives (every 25 steps) ever names a slowdown: 0 or 1."""
    return int(any(detect([s for s in steps if s.step <= seen], nodes=NODES) for seen in range(50, STEPS, 25)))


def _hook_overhead() -> float | None:
    """The timing hook's cost over a step (`bench/timing_hook.py`, one short run), or None without torch."""
    if importlib.util.find_spec("torch") is None:
        return None
    from timing_hook import measure  # noqa: PLC0415 - the sibling bench, needed only where torch is

    overhead: float = measure(steps=500, runs=1)["hook_overhead"]
    return overhead


def run(seeds: int) -> dict[str, Any]:
    """Every measure, medians over `seeds` seeds."""
    by_slowdown: dict[str, float | None] = {}
    for slowdown in SLOWDOWNS:
        delays = [d for seed in range(seeds) if (d := _detection_steps(seed, slowdown)) is not None]
        by_slowdown[str(slowdown)] = statistics.median(delays) if len(delays) * 2 > seeds else None
    clean = [simulate(1000 + seed, None, 0.0) for seed in range(seeds)]
    false_alarms = sum(_false_alarms(steps) for steps in clean)
    right = total = 0
    for seed in range(seeds):
        for kind in SlowClass:
            for slowdown in SLOWDOWNS:
                found = detect(simulate(2000 + seed, kind, slowdown), nodes=NODES)
                total += 1
                named = kind is SlowClass.DEGRADED_LINK or (found is not None and found.rank == SLOW_RANK)
                right += found is not None and found.kind is kind and named
    return {
        "detection_steps": by_slowdown["0.25"],
        "detection_steps_by_slowdown": by_slowdown,
        "false_alarms": false_alarms,
        "clean_runs": seeds,
        "class_accuracy": round(right / total, 3),
        "hook_overhead": _hook_overhead(),
        "naive_false_alarms": sum(_naive_alarms(steps) for steps in clean),
        "model": {"ranks": RANKS, "steps": STEPS, "onset": ONSET, "noise": NOISE, "checkpoint_every": CHECKPOINT_EVERY},
    }


def main() -> None:
    """Print the measures as one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=7)
    args = parser.parse_args()
    print(json.dumps(run(args.seeds)))


if __name__ == "__main__":
    main()
