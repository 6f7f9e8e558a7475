"""What the torch timing hook (`lanes_agent.torch_timing`) costs a training step, against the same loop unhooked.

    uv run python bench/timing_hook.py [--steps N] [--runs R]

One process, a gloo group of one, the drill workload's kind of step (a small MLP, its gradients all-reduced
parameter by parameter, an SGD step): R runs unhooked and R hooked, alternating, each in a fresh Python, in
which N steps are timed after 20 of warm-up. The hook's lines go to a list, not to a pipe, so what is
measured is the hook, not the terminal. That whole-step comparison is noisy on a shared machine (the hook
costs microseconds, a step varies by more), so the hook's own cost is also measured directly: a wrapped
collective against the bare function a million times, and a step's end (its line printed and flushed to
/dev/null) a hundred thousand (`hook_cost_us` per step for
this loop's 4 collectives). Prints one JSON object: the median step times, `hook_overhead` (the hook's
measured cost over the unhooked step: the figure to hold to at most 0.01) and `step_ratio` (hooked over
unhooked step time, noise included). Needs torch (the `drill` group).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path
from typing import Any

from lanes_agent.torch_timing import StepClock

COLLECTIVES_PER_STEP = 4
"""The loop's all-reduces per step (one per parameter tensor of its two layers)."""

_LOOP = r"""
import json, sys, time, torch, torch.distributed as dist
steps, hooked, store = int(sys.argv[1]), sys.argv[2] == "hooked", sys.argv[3]
if hooked:
    from lanes_agent import torch_timing
    lines = []
    torch_timing.install(lines.append)
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimiser = torch.optim.SGD(model.parameters(), lr=0.01)
batch = torch.randn(32, 64)
def step():
    loss = model(batch).pow(2).mean()
    optimiser.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    optimiser.step()
for _ in range(20):
    step()
began = time.perf_counter()
for _ in range(steps):
    step()
print(json.dumps({"step_s": (time.perf_counter() - began) / steps}))
"""


def _run(steps: int, mode: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        ran = subprocess.run(
            [sys.executable, "-c", _LOOP, str(steps), mode, str(Path(tmp) / "store")],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
    return float(json.loads(ran.stdout.splitlines()[-1])["step_s"])


def hook_cost_s(calls: int = 1_000_000) -> float:
    """Seconds the hook adds to one step of the loop: its collectives' wrappers and the step's end."""
    with Path(os.devnull).open("w", encoding="utf-8") as sink:  # the line printed and flushed, as the hook does

        def out(line: str) -> None:
            print(line, file=sink, flush=True)

        clock = StepClock(out)

        def bare() -> None:
            return None

        wrapped = clock.timed(bare)
        per_call = (timeit.timeit(wrapped, number=calls) - timeit.timeit(bare, number=calls)) / calls
        per_step_end = timeit.timeit(clock.step_done, number=calls // 10) / (calls // 10)
    return COLLECTIVES_PER_STEP * max(per_call, 0.0) + per_step_end


def measure(steps: int = 2000, runs: int = 3) -> dict[str, Any]:
    """Median step time unhooked and hooked over `runs` alternating runs, and the hook's overhead."""
    plain: list[float] = []
    hooked: list[float] = []
    for _ in range(runs):
        plain.append(_run(steps, "plain"))
        hooked.append(_run(steps, "hooked"))
    base, with_hook = statistics.median(plain), statistics.median(hooked)
    cost = hook_cost_s()
    return {
        "steps": steps,
        "runs": runs,
        "plain_step_ms": round(base * 1000, 4),
        "hooked_step_ms": round(with_hook * 1000, 4),
        "step_ratio": round(with_hook / base, 4),
        "hook_cost_us": round(cost * 1e6, 3),
        "hook_overhead": round(cost / base, 5),
    }


def main() -> None:
    """Print the measure as one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(measure(args.steps, args.runs)))


if __name__ == "__main__":
    main()
