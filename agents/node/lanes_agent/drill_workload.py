"""The drill workload: a small data-parallel training run for `lanes drill` (torch.distributed, gloo, CPU).

The node agent runs it as each rank (`python -m lanes_agent.drill_workload`) with the environment it gives
every rank: RANK, WORLD_SIZE and MASTER_ADDR/MASTER_PORT for the rendezvous, LANES_CHECKPOINT_DIR,
LANES_RESUME_STEP and the versions the job trains with. It really trains:
- every step all-reduces its gradients across the gang, and reports how long it computed and how long it
  waited in the all-reduces;
- rank 0 checkpoints every `--checkpoint-every` steps and prints the line the agent reads (with the versions,
  so recovery can verify the checkpoint before resuming from it);
- it resumes from LANES_RESUME_STEP's checkpoint;
- each step's batch is allocated afresh and large enough to be mapped from the kernel, as a data loader's
  is, so under a squeezed memory limit the next step is over it.

When a collective fails (a peer timed out or went away) it writes its Flight Recorder buffer where the agent
collects it (`TORCH_FR_DUMP_TEMP_FILE` + rank), as NCCL's watchdog does on a timeout: gloo records the
collectives (`TORCH_FR_BUFFER_SIZE`) but never dumps on its own in this torch.

It honours the drills' fault hooks: SIGUSR1 raises an exception at the next step (the model's bug), SIGUSR2
fails the next step as a CUDA call fails after a GPU fault. torch is not a dependency of Lanes itself; it
comes with the `drills` dependency group.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

_VERSIONS = {
    "model_version": "LANES_MODEL_VERSION",
    "data_version": "LANES_DATA_VERSION",
    "config_version": "LANES_CONFIG_VERSION",
    "image": "LANES_IMAGE",
}
_BATCH = (4096, 64)
"""1 MiB of float32 per step: above glibc's mmap threshold, so each batch is fresh memory from the kernel."""
_faults: list[int] = []


def _load_batch() -> torch.Tensor:
    """This step's batch, read into memory mapped afresh, as a data loader hands one over.

    A new mapping each step is new memory for the kernel to charge: under a squeezed limit the next step is
    over it at once, where the allocator's reuse of freed memory would hide it for minutes.
    """
    with mmap.mmap(-1, _BATCH[0] * _BATCH[1] * 4) as buffer:
        view = torch.frombuffer(buffer, dtype=torch.float32).view(*_BATCH)
        view.copy_(torch.randn(*_BATCH))  # every page touched: charged to the rank's cgroup
        batch = view.clone()
        del view  # the mapping can close only once nothing points into it
    return batch


def _say(line: str) -> None:
    print(line, flush=True)  # noqa: T201 - its output is what the agent reads: readiness, steps, checkpoints


def _on_fault_signal(signum: int, _frame: FrameType | None) -> None:
    _faults.append(signum)  # acted on at the next step, between collectives, as a real failure would surface


def _dump_flight_recorder(rank: int) -> None:
    """This rank's Flight Recorder buffer at `TORCH_FR_DUMP_TEMP_FILE<rank>`, whole or not at all (renamed in)."""
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
    if not prefix or not os.environ.get("TORCH_FR_BUFFER_SIZE"):
        return
    from torch._C._distributed_c10d import _dump_fr_trace_json  # noqa: PLC0415 - torch's own dump call, torch loaded

    path = Path(f"{prefix}{rank}")
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(_dump_fr_trace_json())
    partial.replace(path)


def _checkpoint(model: torch.nn.Module, step: int, directory: Path) -> str:
    path = directory / f"step-{step}.pt"
    torch.save(model.state_dict(), path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    versions = " ".join(f"{field}={os.environ[var]}" for field, var in _VERSIONS.items() if os.environ.get(var))
    return f"lanes: checkpoint saved step={step} path={path} digest=sha256:{digest} {versions}".strip()


def main() -> None:
    """Train until `--steps`, or until a fault."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--step-s", type=float, default=0.05, help="Pause per step (keeps a drill's gang slow).")
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--timeout-s", type=float, default=20.0, help="How long a collective waits for a peer.")
    args = parser.parse_args()
    signal.signal(signal.SIGUSR1, _on_fault_signal)
    signal.signal(signal.SIGUSR2, _on_fault_signal)

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(_BATCH[1], 1)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.01)
    directory = Path(os.environ.get("LANES_CHECKPOINT_DIR", "."))
    directory.mkdir(parents=True, exist_ok=True)
    start = int(os.environ.get("LANES_RESUME_STEP") or 0)
    if start:
        model.load_state_dict(torch.load(directory / f"step-{start}.pt"))
    dist.barrier()
    _say("lanes: communicator ready")

    for step in range(start + 1, args.steps + 1):
        if signal.SIGUSR1 in _faults:
            msg = f"drill: injected failure in rank {rank} at step {step}"
            raise RuntimeError(msg)
        if signal.SIGUSR2 in _faults:
            msg = "CUDA error: uncorrectable ECC error encountered"
            raise RuntimeError(msg)
        started = time.perf_counter()
        batch = _load_batch()
        loss = model(batch).pow(2).mean()
        optimiser.zero_grad()
        loss.backward()
        waited = 0.0
        for parameter in model.parameters():
            assert parameter.grad is not None  # noqa: S101 - backward() just filled it
            entered = time.perf_counter()
            try:
                dist.all_reduce(parameter.grad)
            except RuntimeError:
                _dump_flight_recorder(rank)
                raise
            waited += time.perf_counter() - entered
            parameter.grad /= world
        optimiser.step()
        time.sleep(args.step_s)  # the rest of a real step's compute
        computed = time.perf_counter() - started - waited
        # Every step's timing: the agent sends them in batches (a heartbeat a second at most), and telemetry
        # reads them for a slow rank (its compute rose) or a degraded link (everyone's wait rose).
        _say(f"lanes: step {step} compute_s={computed:.6f} wait_s={waited:.6f}")
        if step % args.checkpoint_every == 0 and rank == 0:
            _say(_checkpoint(model, step, directory))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
