"""Real parts for the router tests: toy replicas, replicas announced on the log, routers in and out of process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from lanes_agent.rank_output import listening_endpoint
from lanes_contract.client import LanesClient, connect_nats
from lanes_contract.codec import decode
from lanes_contract.events import (
    JobPlaced,
    JobPlacedData,
    JobStateChanged,
    JobStateChangedData,
    JobSubmitted,
    JobSubmittedData,
    RankAssignment,
    ReplicaListening,
    ReplicaListeningData,
    RequestServed,
)
from lanes_contract.jobs import JobSpec, JobState, ServingSpec, WorkloadClass
from lanes_contract.streams import REQUESTS, provision_streams
from lanes_router.domain.routing import affinity_rank
from lanes_router.entrypoints.config import RouterConfig
from lanes_router.entrypoints.runner import RouterRunner
from lanes_runtime.cache import connect_redis
from lanes_runtime.reader import Selection, iter_stream
from lanes_runtime.settings import ServerUrls
from support.waiting import eventually

LISTENING = "Uvicorn running on "
TEST_CONFIG = {
    "probe_interval_s": 0.1,
    "ready_probe_interval_s": 0.5,
    "first_token_timeout_s": 2.0,
    "request_timeout_s": 5.0,
    "stream_idle_timeout_s": 3.0,
    "penalty_base_s": 0.5,
    "penalty_max_s": 2.0,
    "shutdown_timeout_s": 5.0,
}
"""Short timings so failures show within a test; routers in subprocesses get them as LANES_ROUTER_* variables."""


@dataclass
class Toy:
    """A running toy replica process."""

    process: subprocess.Popen[str]
    endpoint: str

    async def control(self, **changes: Any) -> dict[str, Any]:
        async with aiohttp.ClientSession() as session, session.post(f"{self.endpoint}/control", json=changes) as r:
            assert r.status == 200, await r.text()
            result: dict[str, Any] = await r.json()
            return result

    async def stats(self) -> dict[str, Any]:
        return await self.control()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)


def start_toy(model: str, version: str, *extra: str) -> Toy:
    """Start `python -m lanes_sandbox.toy_replica` and read its endpoint from the line it prints."""
    process = subprocess.Popen(
        [sys.executable, "-m", "lanes_sandbox.toy_replica", "--model", model, "--version", version, *extra],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    assert LISTENING in line, line
    endpoint = line.split(LISTENING, 1)[1].split()[0]
    assert listening_endpoint(line) == endpoint  # the launcher finds it as it finds vLLM's
    return Toy(process, endpoint)


@contextlib.asynccontextmanager
async def toys(*specs: tuple[str, str]) -> AsyncIterator[list[Toy]]:
    started = [start_toy(model, version) for model, version in specs]
    try:
        yield started
    finally:
        for toy in started:
            toy.kill()


def serving(model: str, version: str, **fields: Any) -> ServingSpec:
    return ServingSpec(model=model, version=version, **fields)


async def announce_replica(
    lanes: LanesClient,
    job_id: str,
    spec: ServingSpec,
    endpoint: str,
    *,
    node: str = "node-1",
    gpus: tuple[int, ...] = (0,),
) -> None:
    """What the scheduler and launcher publish for an inference job: submitted, placed, listening."""
    job = JobSpec(name=job_id, workload_class=WorkloadClass.INFERENCE, workers=1, serving=spec)
    await lanes.publish(JobSubmitted(source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=job)))
    placement = JobPlacedData(assignments=(RankAssignment(rank=0, node=node, gpus=gpus),))
    await lanes.publish(JobPlaced(source="tests", jobid=job_id, attempt=1, data=placement))
    listening = ReplicaListeningData(endpoint=endpoint)
    await lanes.publish(ReplicaListening(source="tests", jobid=job_id, attempt=1, node=node, data=listening))


async def end_job(lanes: LanesClient, job_id: str, state: JobState) -> None:
    data = JobStateChangedData(from_state=JobState.RUNNING, to_state=state, cause_type="tests")
    await lanes.publish(JobStateChanged(source="tests", jobid=job_id, attempt=1, data=data))


@contextlib.asynccontextmanager
async def lanes_client(urls: ServerUrls) -> AsyncIterator[LanesClient]:
    client = await LanesClient.connect(urls.nats_url, source="tests")
    await provision_streams(client.js)
    try:
        yield client
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def router_in_process(urls: ServerUrls, **overrides: Any) -> AsyncIterator[tuple[RouterRunner, str]]:
    """A router running in this event loop; yields it and its URL once it listens."""
    nc = await connect_nats(urls.nats_url, name="tests-router")
    redis = await connect_redis(urls.redis_url)
    runner = RouterRunner(nc, redis, RouterConfig(port=0, **(TEST_CONFIG | overrides)))
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:
        url = await asyncio.wait_for(asyncio.shield(runner.url()), timeout=30)
        yield runner, url
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)
        await redis.aclose()
        await nc.close()


@dataclass
class RouterProcess:
    """A router in its own process (`python -m lanes_router`)."""

    process: subprocess.Popen[str]
    url: str

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=30)


def start_router_process(urls: ServerUrls, **overrides: Any) -> RouterProcess:
    """Start `python -m lanes_router` and read its URL from its "router listening" log line."""
    settings = TEST_CONFIG | {"port": 0} | overrides
    env = os.environ | {
        "NATS_URL": urls.nats_url,
        "REDIS_URL": urls.redis_url,
        "LANES_LOG_FORMAT": "json",
        **{f"LANES_ROUTER_{name.upper()}": str(value) for name, value in settings.items()},
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "lanes_router"], env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )
    assert process.stderr is not None
    deadline = time.monotonic() + 60
    said: list[str] = []
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        said.append(line)
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record.get("event") == "router listening":
                # Keep draining stderr so the router never blocks on a full pipe.
                threading.Thread(target=process.stderr.read, daemon=True).start()
                return RouterProcess(process, record["url"])
    process.kill()
    msg = f"the router process did not start listening (exit {process.wait(10)}); it said:\n{''.join(said[-20:])}"
    raise AssertionError(msg)


async def chat(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    *,
    stream: bool = False,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> tuple[int, dict[str, str], bytes]:
    body = {"model": model, "messages": [{"role": "user", "content": "hello there"}], "stream": stream, **extra}
    async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers or {}) as response:
        return response.status, dict(response.headers), await response.read()


def sse_events(body: bytes) -> list[Any]:
    """The data of each SSE event, JSON-decoded ("[DONE]" kept as the string)."""
    events: list[Any] = []
    for block in body.decode().split("\n\n"):
        line = block.strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def wait_routable(
    session: aiohttp.ClientSession, url: str, model: str, count: int, *, version: str | None = None
) -> None:
    """Wait until the router has `count` ready replicas of the model (and version)."""

    async def ready() -> bool:
        async with session.get(f"{url}/v1/models") as response:
            body = await response.json()
        for entry in body["data"]:
            if entry["id"] == model:
                versions = entry["versions"]
                ready_count = sum(v["ready"] for name, v in versions.items() if version in {None, name})
                return bool(ready_count >= count)
        return False

    await eventually(ready, timeout_s=30, what=f"{count} ready replica(s) of {model}")


async def served_events(lanes: LanesClient, model: str) -> list[RequestServed]:
    """Every `RequestServed` stored for a model, in stream order."""
    events: list[RequestServed] = []
    async for msg in iter_stream(lanes.js, Selection(REQUESTS.name, f"lanes.req.{model}.>")):
        event = decode(msg.subject, msg.headers, msg.data)
        assert isinstance(event, RequestServed)
        events.append(event)
    return events


async def wait_served(lanes: LanesClient, model: str, count: int) -> list[RequestServed]:
    """Wait until `count` request events of the model are stored; return them."""
    found: list[RequestServed] = []

    async def enough() -> bool:
        found[:] = await served_events(lanes, model)
        return len(found) >= count

    await eventually(enough, timeout_s=30, what=f"{count} provenance events of {model}")
    return found


def preferred_replica(replica_ids: list[str], prompt: str) -> str:
    """Which replica prefix affinity sends a prompt to first (the domain's rendezvous hash)."""
    return max(replica_ids, key=lambda r: affinity_rank(r, prompt))


@dataclass
class Routed:
    """One toy replica announced and routable behind an in-process router."""

    toy: Toy
    session: aiohttp.ClientSession
    lanes: LanesClient
    url: str


@contextlib.asynccontextmanager
async def routed_replica(
    urls: ServerUrls, replica_id: str, spec: ServingSpec, **placement: Any
) -> AsyncIterator[Routed]:
    """A toy replica serving `spec`, announced as `replica_id` (placement: node, gpus), routable through a router."""
    async with (
        toys((spec.model, spec.version)) as (toy,),
        aiohttp.ClientSession() as session,
        lanes_client(urls) as lanes,
        router_in_process(urls) as (_runner, url),
    ):
        await announce_replica(lanes, replica_id, spec, toy.endpoint, **placement)
        await wait_routable(session, url, spec.model, 1)
        yield Routed(toy, session, lanes, url)
