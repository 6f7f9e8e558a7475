"""The inference POC's version steps, driven for real: an upgrade, a rollback and a scale-down under load.

The plan's replicas (two by default) of its first version serve the toy model behind the router, while the
plan's streaming clients run the whole time. Then:
- upgrade: as many replicas of the second version join with a lower weight (the router splits traffic by weight),
  and one of them is killed (`lanes drill --kind replica-kill`) with streams in flight; the runner waits for
  recovery's replacement to be back in rotation;
- rollback: every second-version replica is drained with streams in flight (`replica-drain`; their streams
  finish where they are, as nothing else serves that version), then cancelled;
- scale-down: one first-version replica hangs after its first tokens (`replica-pause`, longer than the
  router's stream idle timeout), then is drained with streams in flight (its spec hands them over after a
  drain timeout) and cancelled.

The runner only drives, waiting on the log (or, for streams in flight, on the toy replica's own counter);
every verdict is read back afterwards from the replicas' timelines and the requests' provenance
(`lanes_cli.poc_inference.judge_versions`).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
from nats.js import JetStreamContext

from lanes_agent.faults import FaultError
from lanes_cli.drill_cli import DrillStep, run_replica_drill
from lanes_cli.poc_plan import Inference
from lanes_cli.timeline import job_timeline, row_kind
from lanes_contract.client import LanesClient
from lanes_contract.events import CancelRequested, CommandData, DrillKind, JobSubmitted, JobSubmittedData
from lanes_contract.ids import new_event_id
from lanes_contract.jobs import FailoverPolicy, JobSpec, Owners, ServingSpec, WorkloadClass

Row = dict[str, Any]
Guard = Callable[[Coroutine[Any, Any, Any], float], Coroutine[Any, Any, Any]]
Progress = Callable[[str], None]

TOKENS = 40
TOKEN_DELAY_MS = 25
"""Each answer streams for about a second: a drill always finds streams in flight."""
UPGRADE_WEIGHT = 50
"""The new version's share against the old one's 100 while both run: a weighted upgrade, not a switch."""
SCALE_DOWN_DRAIN_S = 1.0
"""How long the replica taken away may finish its streams before the router hands them to the other."""
PAUSE_S = 6.0
"""How long replica-pause hangs a replica: past the router's stream idle timeout, so its streams move."""
STREAM_IDLE_TIMEOUT_S = 3.0
"""The router's stream idle timeout in `lanes poc run` (LANES_ROUTER_STREAM_IDLE_TIMEOUT_S, unless set)."""
_POLL_S = 0.2
_OWNERS = Owners(platform="serving-oncall", host="node-oncall")


@dataclass(frozen=True)
class VersionsRun:
    """The replica jobs of the story, by version, and the drills' notes (a drill that could not be made)."""

    replicas: dict[str, tuple[str, ...]]
    notes: tuple[str, ...]

    @property
    def job_ids(self) -> list[str]:
        """Every replica job of the story."""
        return [job for jobs in self.replicas.values() for job in jobs]


def replica_spec(inference: Inference, name: str, version: str, *, weight: int, drain_s: float | None) -> JobSpec:
    """One replica of the toy model: one GPU, a toy server streaming TOKENS tokens."""
    command = (
        sys.executable, "-m", "lanes_sandbox.toy_replica", "--model", inference.model, "--version", version,
        "--port", "0", "--tokens", str(TOKENS), "--token-delay-ms", str(TOKEN_DELAY_MS),
    )  # fmt: skip
    serving = ServingSpec(
        model=inference.model,
        version=version,
        weight=weight,
        max_concurrency=64,
        failover=FailoverPolicy(drain_timeout_s=drain_s),
    )
    return JobSpec(
        name=name,
        workload_class=WorkloadClass.INFERENCE,
        workers=1,
        gpus_per_worker=1,
        command=command,
        serving=serving,
        owners=_OWNERS,
    )


class _Story:
    def __init__(self, client: LanesClient, inference: Inference, guard: Guard, timeout_s: float) -> None:
        self.client = client
        self.js: JetStreamContext = client.js
        self.inference = inference
        self.guard = guard
        self.timeout_s = timeout_s
        self.notes: list[str] = []
        self.endpoints: dict[str, str] = {}

    async def rows(self, job: str) -> list[Row]:
        return [entry.as_json() for entry in await job_timeline(self.js, job)]

    async def until(
        self, what: str, check: Callable[[], Coroutine[Any, Any, bool]], timeout_s: float | None = None
    ) -> None:
        async def poll() -> None:
            while not await check():  # noqa: ASYNC110 - the log is the only clock
                await asyncio.sleep(_POLL_S)

        try:
            await self.guard(poll(), timeout_s or self.timeout_s)
        except TimeoutError:
            msg = f"the inference steps timed out waiting for {what}"
            raise TimeoutError(msg) from None

    async def submit(self, job: str, spec: JobSpec) -> None:
        await self.client.publish(
            JobSubmitted(source=self.client.source, jobid=job, attempt=1, data=JobSubmittedData(spec=spec))
        )

    async def ready(self, jobs: tuple[str, ...], *, attempt_at_least: int = 1) -> bool:
        for job in jobs:
            rows = await self.rows(job)
            states = [
                r for r in rows if row_kind(r) == "replica_state" and int(r.get("attempt") or 0) >= attempt_at_least
            ]
            if not states or (states[-1].get("data") or {}).get("state") != "ready":
                return False
            listening = [r for r in rows if row_kind(r) == "replica_listening"]
            if listening:
                self.endpoints[job] = str((listening[-1].get("data") or {}).get("endpoint"))
        return True

    async def released(self, jobs: tuple[str, ...]) -> bool:
        for job in jobs:
            states = [r for r in await self.rows(job) if row_kind(r) == "state_changed"]
            if not states or (states[-1].get("data") or {}).get("to_state") != "released":
                return False
        return True

    async def in_flight(self, session: aiohttp.ClientSession, job: str) -> int:
        """The toy replica's own count of requests it is answering (0 when it does not answer)."""
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with session.get(f"{self.endpoints[job]}/control", timeout=aiohttp.ClientTimeout(total=1)) as r:
                return int((await r.json())["in_flight"])
        return 0

    async def busiest(self, session: aiohttp.ClientSession, jobs: tuple[str, ...]) -> str:
        """The first of `jobs` seen with a stream in flight: a drill on it cuts a stream."""
        found: list[str] = []

        async def any_busy() -> bool:
            found[:] = [job for job in jobs if await self.in_flight(session, job)]
            return bool(found)

        await self.until(f"a stream in flight on {' or '.join(jobs)}", any_busy)
        return found[0]

    async def drill(self, job: str, kind: DrillKind, duration_s: float | None = None) -> None:
        step = DrillStep(job=job, kind=kind, rank=0, duration_s=duration_s)
        try:
            await self.guard(
                run_replica_drill(self.client, step, timeout_s=self.timeout_s, by="lanes/poc"), self.timeout_s
            )
        except FaultError as exc:
            self.notes.append(f"{kind.value} of {job} not injected: {exc}")
        except TimeoutError:
            self.notes.append(f"{kind.value} of {job}: no stream in flight recorded within {self.timeout_s:g} s")

    async def cancel(self, jobs: tuple[str, ...], why: str) -> None:
        for job in jobs:
            command = CommandData(reason=why, requested_by=self.client.source)
            await self.client.publish(CancelRequested(source=self.client.source, jobid=job, data=command))
        await self.until(f"{', '.join(jobs)} released", lambda: self.released(jobs))


async def _client(session: aiohttp.ClientSession, url: str, model: str, prefix: str, stop: asyncio.Event) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Which lane owns this?"}], "stream": True}
    sent = 0
    while not stop.is_set():
        sent += 1
        headers = {"X-Request-Id": f"{prefix}-{sent}"}
        with contextlib.suppress(aiohttp.ClientError):
            async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as response:
                await response.read()  # what the client saw is read back from provenance, not from here
                if response.status != 200:  # noqa: PLR2004 - HTTP OK
                    await asyncio.sleep(0.1)


async def run_versions(  # noqa: PLR0917 - the runner's parts, passed as they are
    client: LanesClient, router_url: str, inference: Inference, guard: Guard, timeout_s: float, progress: Progress
) -> VersionsRun:
    """Drive the upgrade, the rollback and the scale-down, each with its drills, under streaming load."""
    story = _Story(client, inference, guard, timeout_s)
    old, new = inference.versions
    suffix = new_event_id()[-8:]
    olds = tuple(f"poc-{old}-{i}-{suffix}" for i in range(1, inference.replicas + 1))
    news = tuple(f"poc-{new}-{i}-{suffix}" for i in range(1, inference.replicas + 1))
    for job in olds:
        await story.submit(job, replica_spec(inference, job, old, weight=100, drain_s=SCALE_DOWN_DRAIN_S))
    await story.until(f"the {old} replicas ready", lambda: story.ready(olds))
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        load = [
            asyncio.create_task(_client(session, router_url, inference.model, f"poc-{suffix}-c{i}", stop))
            for i in range(inference.clients)
        ]
        try:
            progress(f"inference upgrade: {new} joins at weight {UPGRADE_WEIGHT}, then one {new} replica is killed")
            for job in news:
                await story.submit(job, replica_spec(inference, job, new, weight=UPGRADE_WEIGHT, drain_s=None))
            await story.until(f"the {new} replicas ready", lambda: story.ready(news))
            killed = await story.busiest(session, news)
            await story.drill(killed, DrillKind.REPLICA_KILL)
            try:
                await story.until(f"{killed} replaced", lambda: story.ready((killed,), attempt_at_least=2), 90.0)
                serving: tuple[str, ...] = news
            except TimeoutError as exc:
                story.notes.append(str(exc))
                serving = tuple(job for job in news if job != killed)
            progress(f"inference rollback: the {new} replicas drained with streams in flight, then cancelled")
            for job in serving:
                await story.busiest(session, (job,))
                await story.drill(job, DrillKind.REPLICA_DRAIN)
            await story.cancel(news, f"rolled back to {old}")
            progress(f"inference scale-down: one {old} replica hangs, then is drained with streams in flight")
            leaving = await story.busiest(session, olds)
            await story.drill(leaving, DrillKind.REPLICA_PAUSE, PAUSE_S)
            await story.until(f"{leaving} back in rotation", lambda: story.ready((leaving,)))
            await story.busiest(session, (leaving,))
            await story.drill(leaving, DrillKind.REPLICA_DRAIN)
            await story.cancel((leaving,), "scaled down by one replica")
            await story.busiest(session, tuple(job for job in olds if job != leaving))  # it serves alone
        finally:
            stop.set()
            await asyncio.gather(*load)
    await story.cancel(olds, "the version steps are over")
    return VersionsRun({old: olds, new: news}, tuple(story.notes))
