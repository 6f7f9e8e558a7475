"""`lanes poc run`: the POC method as one run, rung by rung, read back from the timeline.

Every service runs in this process (as `lanes demo` runs them) with a node agent for the plan's simulated
nodes. For each rung the runner submits the plan's training job on that many nodes, waits for its first
verified checkpoint, injects the rung's drills with `lanes drill`'s own code, lets recovery resume the job,
and waits for the job to end. It only drives; every figure is read back from the job's timeline afterwards
(`lanes_cli.poc_rung`). A rung that cannot be placed is judged by the scheduler's own wait reason and
cancelled; a rung that runs out of time is judged as its timeline stands. Between rungs, nodes recovery
cordoned are made ready again, so each rung starts on the same cluster and only the scale changes.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from nats.js import JetStreamContext

from lanes_agent import netns
from lanes_agent.faults import KMSG, FaultError
from lanes_agent.launcher import LocalLauncher
from lanes_agent.netns import NodeNetworks
from lanes_cli.bootstrap import SERVICES, prepare_services
from lanes_cli.demo import FaultPaths, guarded, wait_for_nodes
from lanes_cli.drill_cli import DrillStep, run_drill
from lanes_cli.poc import Verdict
from lanes_cli.poc_inference import NOT_DRIVEN, inference_verdict, judge_inference, judge_versions
from lanes_cli.poc_plan import InferenceStep, Plan, Rung
from lanes_cli.poc_rung import RungResult, diffs, judge
from lanes_cli.poc_serve import STREAM_IDLE_TIMEOUT_S, run_versions
from lanes_cli.replay import Pace, merged, write_ndjson
from lanes_cli.scenarios.inference import replica_node_fails
from lanes_cli.timeline import job_timeline, read_stream, row_kind
from lanes_contract.client import LanesClient
from lanes_contract.events import (
    CancelRequested,
    CommandData,
    JobSubmitted,
    JobSubmittedData,
    NodeRegistered,
    NodeRegisteredData,
    NodeStateChanged,
    NodeStateChangedData,
)
from lanes_contract.ids import new_event_id
from lanes_contract.jobs import JobSpec, Owners, WorkloadClass
from lanes_contract.signing import Keyring
from lanes_contract.streams import JOBS, NODES, REQUESTS
from lanes_contract.topology import NodeState
from lanes_router.entrypoints.runner import RouterRunner
from lanes_runtime.reader import Selection, count
from lanes_runtime.service import Connections, connected, run_consumers
from lanes_runtime.settings import ServerUrls, configured_keyring
from lanes_scheduler import views as scheduler

SOURCE = "lanes/poc"
Row = dict[str, Any]
_T = TypeVar("_T")
_POLL_S = 0.5
_NODES_PER_LEAF = 2
"""The simulated nodes sit two to a leaf under one spine: a rung of 4 nodes crosses leaves, as a real one would."""
OWNERS = Owners(algorithm="algorithm-team", host="host-team", network="network-team", platform="platform-team")
Progress = Callable[[str], None]


def cluster_nodes(plan: Plan) -> list[str]:
    """The simulated nodes' names."""
    return [f"poc-node-{i}" for i in range(1, plan.cluster.nodes + 1)]


def training_spec(plan: Plan, rung: Rung, checkpoints: Path) -> JobSpec:
    """The same job at every rung: only the number of ranks (one per node, holding its GPUs) changes."""
    training = plan.training
    command = training.command or (
        sys.executable, "-m", "lanes_agent.drill_workload",
        "--steps", str(training.steps),
        "--step-s", str(training.step_s),
        "--checkpoint-every", str(training.checkpoint_every),
        "--timeout-s", str(training.collective_timeout_s),
    )  # fmt: skip
    return JobSpec(
        name=f"{plan.name}-train",
        workload_class=WorkloadClass.TRAINING,
        workers=rung.nodes,
        gpus_per_worker=rung.gpus,
        command=command,
        checkpoint_location=str(checkpoints),
        host_memory_gib=training.host_memory_gib,
        retry_budget=max(3, len(rung.drills) + 1),
        owners=OWNERS,
    )


@dataclass(frozen=True)
class PocRun:
    """The run's conclusion, and the node stream rows and interfaces the diff was read from."""

    plan: Plan
    rungs: list[dict[str, Any]]
    inference: dict[str, Any]
    diff: list[dict[str, Any]]
    job_ids: list[str]

    def verdicts(self) -> list[dict[str, Any]]:
        """Every cell of the capabilities x rungs table, then the inference steps' own."""
        cells = [cell for rung in self.rungs for cell in rung["verdicts"]]
        return cells + list(self.inference.get("verdicts", []))

    def as_json(self, report: str | None = None) -> dict[str, Any]:
        """The JSON contract of `lanes poc run --json`."""
        return {
            "plan": self.plan.model_dump(mode="json"),
            "rungs": self.rungs,
            "inference": {"steps": self.inference["steps"]},
            "verdicts": [
                {key: cell[key] for key in ("capability", "rung", "verdict", "missing")} for cell in self.verdicts()
            ],
            "diff": self.diff,
            "report": report,
        }


async def _rows(js: Any, job_id: str, keyring: Keyring | None = None) -> list[Row]:
    return [entry.as_json() for entry in await job_timeline(js, job_id, keyring)]


def _states(rows: list[Row]) -> list[tuple[int, str]]:
    return [
        (int(r.get("attempt") or 1), str((r.get("data") or {}).get("to_state")))
        for r in rows
        if row_kind(r) == "state_changed"
    ]


def _drillable(rows: list[Row]) -> bool:
    """The job runs an attempt that has saved a checkpoint: a fault now has something to resume from."""
    states = _states(rows)
    if not states or states[-1][1] != "running":
        return False
    attempt = states[-1][0]
    return any(row_kind(r) == "checkpoint_saved" and r.get("attempt") == attempt for r in rows)


def _finished(rows: list[Row]) -> bool:
    """The job is over: completed and released, waiting for its owner, cancelled or rejected."""
    states = [state for _, state in _states(rows)]
    if any(row_kind(r) == "rejected" for r in rows):
        return True
    if not states:
        return False
    if states[-1] == "awaiting_manual":
        return True
    return states[-1] == "released" and len(states) >= 2 and states[-2] in {"succeeded", "cancelled"}  # noqa: PLR2004


def _stopped_early(rows: list[Row]) -> bool:
    return _finished(rows) or any(row_kind(r) == "waiting" for r in rows)


class _Runner:
    def __init__(
        self,
        conns: Connections,
        plan: Plan,
        work_dir: Path,
        workers: list[asyncio.Task[None]],
        progress: Progress,
        *,
        networks: NodeNetworks | None = None,
    ) -> None:
        self.conns = conns
        self.client = LanesClient(conns.nc, SOURCE)
        self.js = conns.nc.jetstream()
        self.plan = plan
        self.work_dir = work_dir
        self.workers = workers
        self.progress = progress
        self.networks = networks

    async def guarded(self, work: Coroutine[Any, Any, _T], timeout_s: float) -> _T:
        return await guarded(work, self.workers, timeout_s)

    async def wait_rows(self, job_id: str, done: Callable[[list[Row]], bool], timeout_s: float) -> list[Row] | None:
        """The job's rows once `done` holds for them; None when `timeout_s` ran out first."""

        async def poll() -> list[Row]:
            while not done(rows := await _rows(self.js, job_id)):  # noqa: ASYNC110 - the log is the only clock
                await asyncio.sleep(_POLL_S)
            return rows

        try:
            return await self.guarded(poll(), timeout_s)
        except TimeoutError:
            return None

    async def rung(self, index: int, rung: Rung, keyring: Keyring | None) -> RungResult:
        job_id = f"poc-r{index + 1}-{rung.nodes}x{rung.gpus}-{new_event_id()[-8:]}"
        timeout = self.plan.rung_timeout_s
        notes: list[str] = []
        spec = training_spec(self.plan, rung, self.work_dir / job_id)
        self.progress(f"rung {index + 1}: {rung.nodes} nodes x {rung.gpus} GPUs, job {job_id}")
        await self.client.publish(
            JobSubmitted(source=SOURCE, jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec))
        )
        cannot_fit = rung.nodes > self.plan.cluster.nodes
        wait = _stopped_early if cannot_fit else (lambda rows: _drillable(rows) or _finished(rows))
        rows = await self.wait_rows(job_id, wait, timeout)
        if rows is not None and cannot_fit and not any(row_kind(r) == "placed" for r in rows):
            return await self.unplaced(index, rung, job_id, rows, keyring)
        if rows is None:
            notes.append(f"no running attempt with a checkpoint within {timeout:g} s: no drill injected")
            # Stopped rather than waited on a second time: the next rung needs the cluster back.
            cancel = CommandData(reason=f"rung {index + 1} ran out of time", requested_by=SOURCE)
            await self.client.publish(CancelRequested(source=SOURCE, jobid=job_id, data=cancel))
        elif _drillable(rows):
            for drill in rung.drills:
                step = DrillStep(job=job_id, kind=drill.kind, rank=drill.rank, duration_s=drill.duration_s)
                self.progress(f"rung {index + 1}: {drill.kind.value} of rank {drill.rank}")
                try:
                    await self.guarded(run_drill(self.client, step, timeout_s=timeout, kmsg=KMSG, by=SOURCE), timeout)
                except FaultError as exc:
                    notes.append(f"{drill.kind.value} drill not injected: {exc}")
                except TimeoutError:
                    notes.append(f"{drill.kind.value} drill had not played out within {timeout:g} s")
                if drill is not rung.drills[-1] and await self.wait_rows(job_id, _drillable, timeout) is None:
                    notes.append("the job did not run again with a checkpoint: later drills not injected")
                    break
        if await self.wait_rows(job_id, _finished, timeout) is None:
            notes.append(f"the job had not ended within {timeout:g} s of its last drill")
        await self.make_nodes_ready()
        rows = await _rows(self.js, job_id, keyring)
        return RungResult(index, rung, job_id, rows, placed=True, notes=notes)

    async def unplaced(
        self, index: int, rung: Rung, job_id: str, rows: list[Row], keyring: Keyring | None
    ) -> RungResult:
        """A rung the cluster cannot hold: the scheduler's own wait reason, then the job cancelled (never a hang)."""
        waiting = next((r for r in rows if row_kind(r) in {"waiting", "rejected"}), None)
        data = (waiting or {}).get("data") or {}
        reason = f"{data.get('reason')}: {data.get('detail')}".rstrip(": ") if waiting else "no wait reason"
        reason += f" (the plan's cluster has {self.plan.cluster.nodes} nodes)"
        cancel = CommandData(reason=f"rung {index + 1} cannot be placed", requested_by=SOURCE)
        await self.client.publish(CancelRequested(source=SOURCE, jobid=job_id, data=cancel))
        await self.wait_rows(job_id, _finished, min(self.plan.rung_timeout_s, 60.0))
        rows = await _rows(self.js, job_id, keyring)
        return RungResult(index, rung, job_id, rows, placed=False, unplaced_reason=reason)

    async def make_nodes_ready(self) -> None:
        """Undo the cordons recovery made, so the next rung starts on the same cluster (an operator's step).

        And bring back up any node link a drill left down (a link-down with no duration is never restored).
        """
        if self.networks is not None:
            for node in self.networks.links:
                if netns.link_is_up(node) is False:
                    self.progress(f"bringing {node}'s link {netns.link_of(node)} back up for the next rung")
                    netns.set_link(node, up=True)
        node_rows = [e.as_json() for e in await read_stream(self.js, Selection(NODES.name, "lanes.node.>"))]
        states: dict[str, str] = {}
        for row in node_rows:
            if row_kind(row) == "state_changed":
                states[str(row.get("node"))] = str((row.get("data") or {}).get("state"))
        for node, state in sorted(states.items()):
            if state != NodeState.READY.value:
                data = NodeStateChangedData(state=NodeState.READY, reason="lanes poc run: the next rung starts")
                await self.client.publish(NodeStateChanged(source=SOURCE, node=node, data=data))

        async def all_ready() -> None:
            async with self.conns.pool.acquire() as conn:
                while any(n.status.state is not NodeState.READY for n in await scheduler.nodes(conn)):  # noqa: ASYNC110
                    await asyncio.sleep(0.1)

        await self.guarded(all_ready(), 60.0)


async def register_cluster(client: LanesClient, plan: Plan) -> None:
    """The plan's nodes, two to a leaf under one spine, each its own NVLink domain."""
    for at, node in enumerate(cluster_nodes(plan)):
        data = NodeRegisteredData(
            gpu_model="H100-80GB",
            gpus=plan.cluster.gpus_per_node,
            gpu_memory_gib=80,
            nvlink_domain=f"nvl-{node}",
            leaf=f"leaf-{at // _NODES_PER_LEAF + 1}",
            spine="spine-1",
        )
        await client.publish(NodeRegistered(id=f"register-{node}", source=SOURCE, node=node, data=data))


def interfaces_of(paths: FaultPaths, nodes: list[str]) -> dict[str, str]:
    """Each node's communication path: its link on the bridge, or the host's loopback they all share."""
    if paths.networks is None:
        return dict.fromkeys(nodes, "lo (shared host network)")
    return {n: f"{link.link} ({link.address})" for n, link in paths.networks.links.items()}


async def run_plan(
    urls: ServerUrls,
    plan: Plan,
    work_dir: Path,
    *,
    paths: FaultPaths | None = None,
    bundle: Path | None = None,
    progress: Progress = print,
) -> PocRun:
    """Run every rung of the plan, then judge each from its timeline; `bundle`: write the run's events there."""
    paths = paths or FaultPaths()
    nodes = cluster_nodes(plan)
    results: list[RungResult] = []
    keyring = configured_keyring()
    if plan.inference is not None:
        # A paused replica's streams move once they have been silent this long (the router's default is a
        # minute, made for real models' slow tokens; the toy model streams a token every 25 ms).
        os.environ.setdefault("LANES_ROUTER_STREAM_IDLE_TIMEOUT_S", str(STREAM_IDLE_TIMEOUT_S))
    async with connected(urls, name="lanes-poc-run") as conns:
        stop = asyncio.Event()
        consumers = await prepare_services(conns, SERVICES)
        launcher = LocalLauncher(
            conns.nc,
            frozenset(nodes),
            durable="agent-poc",
            stop_grace_s=2.0,
            kernel_log=KMSG if paths.through_kernel else None,
            kernel_log_position=work_dir / "kmsg.position",
            state_dir=work_dir / "ledger",
            networks=paths.networks,
        )
        workers = [
            asyncio.create_task(run_consumers(consumers, stop), name="services"),
            asyncio.create_task(launcher.run(stop), name="launcher"),
        ]
        runner = _Runner(conns, plan, work_dir, workers, progress, networks=paths.networks)
        try:
            await register_cluster(runner.client, plan)
            await runner.guarded(wait_for_nodes(conns, len(nodes), 60.0), 60.0)
            for index, rung in enumerate(plan.rungs):
                results.append(await runner.rung(index, rung, keyring))
            inference: dict[str, Any] = {"steps": [], "verdicts": [], "job_ids": []}
            if plan.inference is not None:
                router = next(consumer for consumer in consumers if isinstance(consumer, RouterRunner))
                inference = await run_inference(runner, router, paths.through_kernel)
        finally:
            stop.set()
            await asyncio.gather(*workers, return_exceptions=True)
        node_rows = [e.as_json() for e in await read_stream(runner.js, Selection(NODES.name, "lanes.node.>"))]
        if bundle is not None:
            await write_bundle(runner.js, bundle)
    rungs = [judge(result, plan.criteria) for result in results]
    return PocRun(
        plan=plan,
        rungs=rungs,
        inference=inference,
        diff=diffs(rungs, node_rows, interfaces_of(paths, nodes)),
        job_ids=[result.job_id for result in results] + inference["job_ids"],
    )


async def write_bundle(js: JetStreamContext, path: Path) -> int:
    """The run's job and node events, merged in time order, one CloudEvent a line: what `lanes import` reads."""
    chosen = [
        Selection(JOBS.name, "lanes.job.>"),
        Selection(NODES.name, "lanes.node.>"),
        Selection(REQUESTS.name, "lanes.req.>"),
    ]
    total = sum([await count(js, selection) for selection in chosen])
    with path.open("wb") as handle:
        return await write_ndjson(merged(js, chosen), handle, Pace("instant"), total)


async def run_inference(runner: _Runner, router: RouterRunner, through_kernel: bool) -> dict[str, Any]:
    """The version steps, then the toy model's node-fault story, behind the router; each step judged after.

    The version steps are the upgrade, the rollback and the scale-down, each with its replica drills
    (`lanes_cli.poc_serve`); every verdict is read from the replicas' timelines and the requests.
    """
    inference = runner.plan.inference
    assert inference is not None  # noqa: S101 - the caller checked
    timeout = runner.plan.rung_timeout_s
    router_url = await runner.guarded(router.url(), timeout)
    driven: dict[InferenceStep, dict[str, Any]] = {}
    version_jobs: list[str] = []
    if set(inference.steps) & set(NOT_DRIVEN):
        try:
            versions = await run_versions(
                runner.client, router_url, inference, runner.guarded, timeout, runner.progress
            )
        except TimeoutError as exc:
            driven = {
                step: {"step": step.value, "verdict": Verdict.PENDING_EVIDENCE.value, "missing": f"{exc}"}
                for step in NOT_DRIVEN
            }
        else:
            version_jobs = versions.job_ids
            rows = {job: await _rows(runner.js, job) for job in version_jobs}
            requests = [e.as_json() for e in await read_stream(runner.js, Selection(REQUESTS.name, "lanes.req.>"))]
            driven = judge_versions(inference.versions, rows, requests, versions.notes)
    runner.progress("inference: two replicas of the toy model behind the router, then a replica's node fails")
    try:
        story = await runner.guarded(
            replica_node_fails(runner.conns, router_url, timeout_s=timeout, through_kernel=through_kernel), timeout
        )
    except TimeoutError as exc:
        steps = [
            driven.get(step)
            or {
                "step": step.value,
                "verdict": Verdict.PENDING_EVIDENCE.value,
                "missing": f"the story did not end: {exc}",
            }
            for step in inference.steps
        ]
        return {"steps": steps, "verdicts": [inference_verdict(steps)], "job_ids": version_jobs}
    replicas = {job: await _rows(runner.js, job) for job in story.replica_job_ids}
    requests = [e.as_json() for e in await read_stream(runner.js, Selection(REQUESTS.name, "lanes.req.>"))]
    steps = judge_inference(inference.steps, replicas, requests, story.replica_job_ids[0], driven)
    return {
        "steps": steps,
        "verdicts": [inference_verdict(steps)],
        "job_ids": version_jobs + list(story.replica_job_ids),
    }
