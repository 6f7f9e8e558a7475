"""Step timings from any torch job: the hook's clock, and the hook on a real torch.distributed (gloo) loop."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.optional import TORCH, require

from lanes_agent.torch_timing import StepClock
from lanes_contract.events import HeartbeatData, StepTiming
from lanes_evidence.progress_lines import progress_report, step_rank


def test_collective_time_is_the_steps_wait_and_the_rest_its_compute() -> None:
    ticks = iter([0.0, 1.0, 1.5, 2.0, 2.25, 3.0, 3.5, 4.0])
    lines: list[str] = []
    clock = StepClock(lines.append, now=lambda: next(ticks))  # the step begins at 0.0
    all_reduce = clock.timed(lambda tensor: tensor * 2)
    assert all_reduce(21) == 42  # entered at 1.0, left at 1.5: what it returns is untouched
    assert all_reduce(1) == 2  # 2.0 -> 2.25
    clock.step_done()  # at 3.0: 3.0 s in the step, 0.75 s of it waiting
    all_reduce(0)  # 3.5 -> 4.0 ... the next step
    assert [progress_report(line) for line in lines] == [
        HeartbeatData(step=1, timings=(StepTiming(step=1, compute_s=2.25, wait_s=0.75),))
    ]
    assert (clock.step, clock.waited) == (1, 0.5)


def test_a_clock_that_knows_its_rank_names_it_on_each_line() -> None:
    lines: list[str] = []
    clock = StepClock(lines.append, now=iter([0.0, 2.0]).__next__, rank=5)
    clock.step_done()
    assert lines == ["lanes: step 1 compute_s=2.000000 wait_s=0.000000 rank=5"]
    assert step_rank(lines[0]) == 5
    assert progress_report(lines[0]) == HeartbeatData(step=1, timings=(StepTiming(step=1, compute_s=2.0, wait_s=0.0),))
    assert step_rank("lanes: step 1 compute_s=2.0 wait_s=0.0") is None


_LOOP = r"""
import json, sys, torch, torch.distributed as dist
hooked = sys.argv[1] == "hooked"
if hooked:
    from lanes_agent import torch_timing
    lines = []
    torch_timing.install(lines.append)
    torch_timing.install(lines.append)  # a second install changes nothing
dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=0, world_size=1)
torch.manual_seed(7)
model = torch.nn.Linear(8, 1)
optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    loss = model(torch.ones(4, 8)).pow(2).mean()
    optimiser.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    optimiser.step()
dist.destroy_process_group()
print(json.dumps({"weights": model.weight.tolist(), "lines": lines if hooked else []}))
"""


def test_the_hook_times_every_step_of_a_real_loop_and_changes_nothing_it_computes(tmp_path: Path) -> None:
    require(TORCH)
    runs = {}
    for mode in ("plain", "hooked"):
        ran = subprocess.run(
            [sys.executable, "-c", _LOOP, mode, str(tmp_path / f"store-{mode}")],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        runs[mode] = json.loads(ran.stdout.splitlines()[-1])
    assert runs["hooked"]["weights"] == runs["plain"]["weights"]
    beats = [progress_report(line) for line in runs["hooked"]["lines"]]
    assert [b.step for b in beats if isinstance(b, HeartbeatData)] == [1, 2, 3, 4, 5]
    assert all(isinstance(b, HeartbeatData) and b.timings[0].wait_s > 0 for b in beats)  # each all-reduce timed
