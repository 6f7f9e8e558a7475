"""`lanes run -- torchrun …` on an unmodified 4-rank torch.distributed (gloo) job in which one rank fails.

torchrun starts four CPU processes that rendezvous over TCP, all-reduce once, and then rank 2 raises while
the others wait in a barrier. The peers see their connection closed and torchrun tears them down with
SIGTERM, so the output holds four tracebacks and torchelastic's failure summary. Lanes must name the same
first error live, from the wrapped output as it streams, as `lanes analyze` does afterwards from the
saved log: rank 2's own exception, in the algorithm lane, not the peers' closed connections.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from support.cli import LANES, local_stack, run_lanes_async
from support.observe import OBSERVE_SERVICES, in_state, job_view, timeline_events
from support.optional import TORCH, require
from support.waiting import eventually

from lanes_contract.events import Heartbeat, JobFinding, RankExited, RankStarted
from lanes_runtime.service import Connections
from lanes_runtime.settings import ServerUrls

pytestmark = [pytest.mark.real_servers, pytest.mark.slow]

require(TORCH)
_TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent))

_FAILING_RANK = 2
# Plain torch.distributed: nothing in it knows about Lanes.
_TRAIN = f"""\
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
total = torch.ones(8) * rank
dist.all_reduce(total)
print(f"rank {{rank}} step 1 reduced {{total[0].item()}}", flush=True)
if rank == {_FAILING_RANK}:
    raise RuntimeError("loss became NaN at step 2")
dist.barrier()
dist.destroy_process_group()
"""


@pytest.fixture
async def stack(own_urls: ServerUrls) -> AsyncIterator[Connections]:
    async with local_stack(own_urls, OBSERVE_SERVICES, nodes=False) as conns:
        yield conns


async def test_torchrun_with_a_failing_rank_gets_the_finding_lanes_analyze_elects_from_its_log(
    stack: Connections, own_urls: ServerUrls, unique: str, tmp_path: Path
) -> None:
    assert _TORCHRUN is not None
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    job_id = f"torchrun-{unique}"
    env = os.environ | {"NATS_URL": own_urls.nats_url, "LANES_LOG_FORMAT": "json", "OMP_NUM_THREADS": "1"}
    command = [_TORCHRUN, "--standalone", "--nproc-per-node", "4"]  # standalone: a free local rendezvous port
    proc = await asyncio.create_subprocess_exec(
        LANES, "run", "--job", job_id, "--node", "n-test", "--outbox", str(tmp_path / "outbox.ndjson"), "--",
        *command, str(script),
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = (stream.decode() for stream in await proc.communicate())
    assert proc.returncode == 1, err  # torchrun's own status, passed through
    assert f"[rank{_FAILING_RANK}]: RuntimeError: loss became NaN at step 2" in err
    assert "Root Cause (first observed failure)" in err

    await eventually(lambda: in_state(own_urls, job_id, "released"), what="the job released", timeout_s=60)
    events = await timeline_events(stack, job_id)
    assert {e.rank for e in events if isinstance(e, RankStarted)} == {0, 1, 2, 3}
    exits = {e.rank: e.data for e in events if isinstance(e, RankExited)}
    # torchelastic's summary names each rank's end. The failing rank exits 1, or dies of SIGABRT when gloo's
    # teardown aborts on its way out (seen under load); the others are stopped by torchrun (SIGTERM) or
    # fail on the closed connection first. Every rank ended, and none of them cleanly.
    assert set(exits) == {0, 1, 2, 3}
    assert exits[_FAILING_RANK].exit_code == 1 or exits[_FAILING_RANK].signal == signal.SIGABRT
    assert not any(exits[r].succeeded for r in (0, 1, 3))

    async def found() -> bool:
        return any(isinstance(e, JobFinding) for e in await timeline_events(stack, job_id))

    await eventually(found, what="a finding", timeout_s=60)
    live = [e for e in await timeline_events(stack, job_id) if isinstance(e, JobFinding)][-1].data

    logs = tmp_path / "logs" / "n-test"
    logs.mkdir(parents=True)
    (logs / "stdout.log").write_text(out)
    (logs / "stderr.log").write_text(err)
    offline = json.loads((await run_lanes_async(None, "analyze", "--json", str(tmp_path / "logs"))).stdout)
    expected = offline["first_error"]
    assert live.first_error is not None
    assert (live.first_error.category, live.first_error.lane.value, live.first_error.rank) == (
        expected["category"],
        expected["lane"],
        expected["rank"],
    )
    assert (expected["lane"], expected["rank"]) == ("algorithm", _FAILING_RANK)
    assert live.first_error.summary == expected["summary"]
    assert live.stage == offline["stage"]
    view = await job_view(own_urls, job_id)
    assert view is not None
    (attempt,) = view["attempts"]
    failing = attempt["ranks"][str(_FAILING_RANK)]
    assert (failing["exit_code"], failing["signal"]) == (exits[_FAILING_RANK].exit_code, exits[_FAILING_RANK].signal)


# Plain torch.distributed training, unmodified: three SGD steps, each all-reducing its gradients.
_STEPS = """\
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    optimiser.zero_grad()
    model(torch.ones(2, 4) * (dist.get_rank() + step)).pow(2).mean().backward()
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad)
    optimiser.step()
# One write per line: the workers share torchrun's unbuffered stdout, where print writes the newline apart.
sys.stdout.write(f"rank {dist.get_rank()} weights {model.weight.sum().item():.9f}\\n")
sys.stdout.flush()
dist.destroy_process_group()
"""


async def _torchrun_steps(own_urls: ServerUrls, tmp_path: Path, job_id: str, *, timing: bool) -> str:
    assert _TORCHRUN is not None
    script = tmp_path / "steps.py"
    script.write_text(_STEPS)
    env = os.environ | {"NATS_URL": own_urls.nats_url, "OMP_NUM_THREADS": "1", "LANES_TORCH_TIMING": str(int(timing))}
    proc = await asyncio.create_subprocess_exec(
        LANES, "run", "--job", job_id, "--node", "n-test", "--outbox", str(tmp_path / f"{job_id}.ndjson"), "--",
        _TORCHRUN, "--standalone", "--nproc-per-node", "2", str(script),
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = (stream.decode() for stream in await proc.communicate())
    assert proc.returncode == 0, err
    return out


async def test_lanes_torch_timing_prints_each_workers_steps_and_changes_nothing_the_job_computes(
    stack: Connections, own_urls: ServerUrls, unique: str, tmp_path: Path
) -> None:
    timed = await _torchrun_steps(own_urls, tmp_path, f"timed-{unique}", timing=True)
    plain = await _torchrun_steps(own_urls, tmp_path, f"plain-{unique}", timing=False)
    steps = [line for line in timed.splitlines() if line.startswith("lanes: step ")]
    # Two workers, three optimizer steps each; each line has the step's compute and its wait in all-reduces.
    assert sorted(line.split()[2] for line in steps) == ["1", "1", "2", "2", "3", "3"], timed
    assert all(" compute_s=" in line and " wait_s=" in line for line in steps)
    assert not [line for line in plain.splitlines() if line.startswith("lanes: step ")]
    weights = sorted(line for line in timed.splitlines() if " weights " in line)
    assert len(weights) == 2
    assert weights == sorted(line for line in plain.splitlines() if " weights " in line)  # bit for bit the same

    # Each line names its worker's rank, so `lanes run` sends every rank's timings as that rank's heartbeats,
    # which is what telemetry reads for slow ranks (as it does from a node agent's ranks).
    async def timed_steps() -> dict[int | None, list[int]]:
        steps: dict[int | None, list[int]] = {}
        for event in await timeline_events(stack, f"timed-{unique}"):
            if isinstance(event, Heartbeat):
                steps.setdefault(event.rank, []).extend(t.step for t in event.data.timings)
        return {rank: sorted(numbers) for rank, numbers in steps.items()}

    async def all_timed() -> bool:
        return await timed_steps() == {0: [1, 2, 3], 1: [1, 2, 3]}

    await eventually(all_timed, what="both ranks' step timings as heartbeats")
    plain_beats = [e for e in await timeline_events(stack, f"plain-{unique}") if isinstance(e, Heartbeat)]
    assert plain_beats == []
