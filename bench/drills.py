"""Drills on a real 4-rank torch.distributed (gloo) training job: Lanes' answer beside torchelastic's own.

For each fault kind (kill, hang, oom, xid, exception), `--runs` times:
- **Lanes**: fresh embedded servers, every service and a node agent for five simulated nodes (one rank per
  node) following the real kernel log; the shipped drill workload runs until its first checkpoint, then
  `lanes drill` injects the fault into rank 2. Measured from the `drill_injected` event: time to detect
  (first evidence), to localise (a settled finding naming rank 2), to decide (recovery's decision) and to
  recover (the next attempt running), and whether the finding named rank 2, its node and the right lane.
  With root, each node's ranks run in a network namespace of their own (so link-down can cut one).
- **torchelastic, the raw baseline beside it**: the same workload under `torchrun --standalone
  --nproc-per-node 4` (each worker in a memory cgroup for the oom kind), the same fault into local rank 2
  (the same function does it), timed to torchrun's exit; what its error summary names as root cause (rank,
  exit code) is recorded. `localise_ratio` = torchrun's time to exit / Lanes' time to localise.

    uv run python bench/drills.py [--runs 3] [--kinds kill,hang]

Prints one JSON object (medians per kind). Root: the oom and xid kinds need cgroups and /dev/kmsg.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lanes_agent.cgroups import MemoryCgroups
from lanes_agent.faults import inject
from lanes_agent.launcher import LocalLauncher
from lanes_agent.netns import NodeNetworks
from lanes_cli.bootstrap import SERVICES, prepare_services
from lanes_cli.drill_cli import DrillStep, run_drill
from lanes_cli.stack import servers
from lanes_cli.timeline import job_timeline
from lanes_contract.client import LanesClient
from lanes_contract.events import (
    CheckpointSaved,
    DrillKind,
    JobSubmitted,
    JobSubmittedData,
    NodeRegistered,
    NodeRegisteredData,
)
from lanes_contract.jobs import JobSpec
from lanes_runtime.log import configure_logging
from lanes_runtime.service import connected, run_consumers
from lanes_runtime.settings import ServerUrls, Settings

KINDS = (DrillKind.KILL, DrillKind.HANG, DrillKind.OOM, DrillKind.XID, DrillKind.EXCEPTION, DrillKind.LINK_DOWN)
NODES = [f"bench-{i}" for i in range(1, 6)]
RANK = 2
KMSG = Path("/dev/kmsg")
WORKLOAD = ("-m", "lanes_agent.drill_workload", "--step-s", "0.05", "--timeout-s", "15")
_VERSION = "sha256:" + "ab" * 32
_ROOT_RANK = re.compile(
    r"Root Cause \(first observed failure\):\s*\[\d+\]:.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.DOTALL
)


async def _until(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            msg = f"timed out waiting for {what}"
            raise TimeoutError(msg)
        await asyncio.sleep(0.5)


async def lanes_run(urls: ServerUrls, kind: DrillKind, scratch: Path) -> dict[str, Any]:
    """One drill through Lanes on fresh servers, each node in a network namespace of its own; its report."""
    networks = None if NodeNetworks.unavailable() else NodeNetworks(NODES)
    if networks is not None:
        networks.up()
    try:
        return await _lanes_drill(urls, kind, scratch, networks)
    finally:
        if networks is not None:
            networks.down()


async def _lanes_drill(
    urls: ServerUrls, kind: DrillKind, scratch: Path, networks: NodeNetworks | None
) -> dict[str, Any]:
    async with connected(urls, name="bench-drills") as conns:
        stop = asyncio.Event()
        consumers = await prepare_services(conns, [name for name in SERVICES if name != "router"])
        agent = LocalLauncher(
            conns.nc,
            frozenset(NODES),
            stop_grace_s=2.0,
            kernel_log=KMSG if os.access(KMSG, os.R_OK) else None,
            kernel_log_position=scratch / "kmsg.position",
            state_dir=scratch / "ledger",
            networks=networks,
        )
        tasks = [asyncio.create_task(run_consumers(consumers, stop)), asyncio.create_task(agent.run(stop))]
        try:
            client = LanesClient(conns.nc, "bench")
            for node in NODES:
                data = NodeRegisteredData(gpu_model="H100", gpus=4, gpu_memory_gib=80)
                await client.publish(NodeRegistered(source="bench", node=node, data=data))

            async def nodes_known() -> bool:  # a job submitted before then is refused as too big for the cluster
                return int(await conns.pool.fetchval("SELECT count(*) FROM scheduler_nodes")) >= len(NODES)

            await _until(nodes_known, 30, "the scheduler to know the nodes")
            spec = JobSpec(
                name="drill",
                workers=4,
                gpus_per_worker=4,
                command=(sys.executable, *WORKLOAD),
                checkpoint_location=str(scratch / "checkpoints"),
                host_memory_gib=4.0,
                model_version=_VERSION,
                data_version=_VERSION,
                config_version=_VERSION,
                image="lanes/drill:1",
            )
            job_id = f"drill-{kind.value}"
            await client.publish(
                JobSubmitted(source="bench", jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec))
            )

            async def checkpointed() -> bool:
                timeline = await job_timeline(conns.nc.jetstream(), job_id)
                return any(isinstance(entry.event, CheckpointSaved) for entry in timeline)

            await _until(checkpointed, 180, "the first checkpoint")
            report = await run_drill(client, DrillStep(job=job_id, kind=kind, rank=RANK), timeout_s=240)
            return report.as_json()
        finally:
            stop.set()
            await asyncio.gather(*tasks)


async def torchrun_run(kind: DrillKind, scratch: Path) -> dict[str, Any]:
    """The same fault under torchrun alone: time to its exit, and the root cause its summary names.

    torchrun's workers share one network: a link cannot be cut under them alone, so link-down has no baseline.
    """
    if kind is DrillKind.LINK_DOWN:
        return {"exit_s": None, "root_cause_rank": None, "root_cause_exitcode": None}
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        msg = "torchrun is not installed (the `drill` dependency group)"
        raise RuntimeError(msg)
    env = os.environ | {"LANES_CHECKPOINT_DIR": str(scratch / "torchrun-checkpoints")}
    proc = await asyncio.create_subprocess_exec(
        torchrun, "--standalone", "--nproc-per-node", "4", *WORKLOAD,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    output: list[str] = []
    ready = asyncio.Event()

    async def read() -> None:
        if proc.stdout is None:  # started with a pipe: never
            return
        async for raw in proc.stdout:
            output.append(raw.decode(errors="replace"))
            if "checkpoint saved" in output[-1]:
                ready.set()

    reader = asyncio.create_task(read())
    await asyncio.wait_for(ready.wait(), 180)
    worker = _worker_of_rank(proc.pid, RANK)
    cgroups = MemoryCgroups()
    group = None
    if kind is DrillKind.OOM:  # torchrun gives workers no cgroup: put rank 2 in one, as the agent would
        group = cgroups.create(f"bench-torchrun-{os.getpid()}", 4.0)
        (group / "cgroup.procs").write_text(str(worker))
    started = time.monotonic()
    injecting = asyncio.create_task(inject(kind, worker, duration_s=None))
    await proc.wait()
    exit_s = time.monotonic() - started
    await reader
    with contextlib.suppress(Exception):
        await injecting
    if group is not None:
        MemoryCgroups.remove(group)
    text = "".join(output)
    found = _ROOT_RANK.search(text)
    return {
        "exit_s": round(exit_s, 3),
        "root_cause_rank": int(found[1]) if found else None,
        "root_cause_exitcode": int(found[2]) if found else None,
    }


def _worker_of_rank(parent: int, rank: int) -> int:
    """The pid of the child of torchrun whose environment says RANK=`rank`."""
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != parent:
                continue
            if f"RANK={rank}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                return int(entry.name)
    msg = f"no worker of rank {rank} under torchrun {parent}"
    raise RuntimeError(msg)


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


def main() -> None:
    """Run every kind `--runs` times, each on fresh servers, and print the medians as one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(k.value for k in KINDS))
    args = parser.parse_args()
    configure_logging("warning")
    result: dict[str, Any] = {"bench": "drills", "runs": args.runs, "rank": RANK, "kinds": {}}
    for kind in (DrillKind(k) for k in args.kinds.split(",")):
        lanes: list[dict[str, Any]] = []
        raw: list[dict[str, Any]] = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="lanes-bench-drill-") as scratch:
                with servers(Settings(nats_url=None, database_url=None, redis_url=None)) as urls:
                    lanes.append(asyncio.run(lanes_run(urls, kind, Path(scratch))))
                raw.append(asyncio.run(torchrun_run(kind, Path(scratch))))
        medians = {key: _median([r[key] for r in lanes]) for key in ("detect_s", "localise_s", "decide_s", "recover_s")}
        exit_s = _median([r["exit_s"] for r in raw])
        result["kinds"][kind.value] = {
            "lanes": medians,
            "named_right": sum(bool(r["named_right"]) for r in lanes),
            "named": [r["named"] for r in lanes],
            "decisions": [r["decision"] for r in lanes],
            "torchrun_exit_s": exit_s,
            "torchrun_root_cause": [{"rank": r["root_cause_rank"], "exitcode": r["root_cause_exitcode"]} for r in raw],
            "localise_ratio": None
            if exit_s is None or not medians["localise_s"]
            else round(exit_s / medians["localise_s"], 3),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
