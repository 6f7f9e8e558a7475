"""Produce real PyTorch Flight Recorder dumps from a 4-rank gloo job in which one rank hangs before a collective.

    uv run python bench/flight_recorder_dumps.py tests/data/flight_recorder/hang_rank2
    uv run python bench/flight_recorder_dumps.py tests/data/flight_recorder/mismatch_rank1 \
        --hung-rank -1 --odd-rank 1 --odd-at 3

Four CPU processes (torch.multiprocessing) join a gloo process group with a short timeout and all-reduce a small
tensor `--steps` times. The `--hung-rank` stops before collective `--hang-at` (1-based, the Flight Recorder's
`collective_seq_id`) and sleeps past the others' timeout, as a rank stuck in its own code would. The others time
out in that collective. With `--odd-rank`, that rank broadcasts where the others all-reduce, at `--odd-at`.
Every rank then dumps its Flight Recorder buffer in the JSON form (`torch._C._distributed_c10d.
_dump_fr_trace_json`, recorded because `TORCH_FR_BUFFER_SIZE` is set before the group is made) to
`rank_<r>.json`: a watchdog's dump on timeout writes the same buffer.

Needs torch (the venv's CPU build); not imported by anything else in the repository.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._C._distributed_c10d import _dump_fr_trace_json

_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class _Plan:
    world: int
    port: int
    out: str
    hung_rank: int
    hang_at: int
    steps: int
    odd_rank: int
    odd_at: int


def _rank_main(rank: int, plan: _Plan) -> None:
    # Read by the process group's constructor: set before init, or nothing is recorded.
    os.environ["TORCH_FR_BUFFER_SIZE"] = "16"
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(plan.port)
    dist.init_process_group("gloo", rank=rank, world_size=plan.world, timeout=dt.timedelta(seconds=_TIMEOUT_S))
    tensor = torch.ones(8)
    try:
        for seq in range(1, plan.steps + 1):
            if rank == plan.hung_rank and seq == plan.hang_at:
                # Stuck before entering the collective, long enough for every other rank to time out in it.
                time.sleep(_TIMEOUT_S * 2)
                break
            # The odd rank calls another collective at `odd_at` (a mismatch, the job's code at fault). Another
            # op, not other sizes: gloo aborts the process on a size mismatch, and no rank would dump.
            if (rank, seq) == (plan.odd_rank, plan.odd_at):
                dist.broadcast(tensor, src=0)
            else:
                dist.all_reduce(tensor)
    except RuntimeError as exc:  # the others' timeout (or the peer closing once it gave up)
        print(f"rank {rank}: {str(exc).splitlines()[0][:160]}", flush=True)
    Path(plan.out, f"rank_{rank}.json").write_bytes(_dump_fr_trace_json())
    # Leave without a barrier or destroy: the group is broken, as it is when a watchdog dumps.
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    """Run the job and write one dump per rank into the output directory."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--hung-rank", type=int, default=2)
    parser.add_argument("--hang-at", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--odd-rank", type=int, default=-1, help="this rank broadcasts instead of all-reducing at...")
    parser.add_argument("--odd-at", type=int, default=0, help="...this collective (1-based)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    mp.spawn(
        _rank_main,
        args=(
            _Plan(
                args.world,
                _free_port(),
                str(args.out),
                args.hung_rank,
                args.hang_at,
                args.steps,
                args.odd_rank,
                args.odd_at,
            ),
        ),
        nprocs=args.world,
    )


if __name__ == "__main__":
    main()
