"""`lanes drill` on an inference replica (issue 44): streaming load over two toy replica processes behind a
router, then the real CLI kills one (SIGKILL), pauses one (SIGSTOP after the first tokens, SIGCONT later) or
drains one with streams in flight. Every client's stream completes, byte for byte the answer never cut, under
one request id; the moved streams' provenance names both replicas; the drill is on the replica's timeline and
its report counts the streams it had in flight, none lost."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from support.cli import run_lanes_async
from support.router import (
    Toy,
    announce_replica,
    chat,
    lanes_client,
    router_in_process,
    serving,
    sse_events,
    toys,
    wait_routable,
    wait_served,
)
from support.waiting import eventually

from lanes_contract.client import LanesClient
from lanes_contract.events import (
    JobStateChanged,
    JobStateChangedData,
    RankStarted,
    RankStartedData,
    RequestServed,
    RequestServedData,
)
from lanes_contract.jobs import FailoverPolicy, JobState
from lanes_runtime.settings import ServerUrls

pytestmark = [pytest.mark.real_servers, pytest.mark.slow]

TOKENS = 60
STREAMS = 8
USAGE = {"include_usage": True}


async def running_replica(lanes: LanesClient, replica_id: str, toy: Toy, node: str) -> None:
    """What the launcher adds for a replica it runs: the attempt running, and rank 0's process."""
    change = JobStateChangedData(
        from_state=JobState.STARTING, to_state=JobState.RUNNING, reason="all ranks ready", cause_type="tests"
    )
    await lanes.publish(JobStateChanged(source="lanes/lifecycle", jobid=replica_id, attempt=1, data=change))
    started = RankStartedData(pid=toy.process.pid)
    await lanes.publish(
        RankStarted(source=f"agent/{node}", jobid=replica_id, attempt=1, rank=0, node=node, data=started)
    )


async def stream(
    session: aiohttp.ClientSession, url: str, model: str, request_id: str, progress: dict[str, int]
) -> tuple[str, bytes]:
    """One streaming chat read as it arrives (`progress`: whole events so far); its X-Request-Id and body."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello there"}],
        "stream": True,
        "stream_options": USAGE,
    }
    async with session.post(f"{url}/v1/chat/completions", json=body, headers={"X-Request-Id": request_id}) as r:
        assert r.status == 200, await r.text()
        received = b""
        async for chunk in r.content.iter_any():
            received += chunk
            progress[request_id] = received.count(b"\n\n")
        return r.headers["X-Request-Id"], received


CASES: dict[str, tuple[str, ...]] = {
    "replica-kill": (),
    "replica-pause": ("--duration", "5"),  # past the router's 3 s stream idle timeout (TEST_CONFIG)
    "replica-drain": (),  # the spec's drain timeout (0.5 s) hands the streams over
}


@pytest.mark.parametrize("kind", list(CASES))
async def test_a_replica_drill_under_streaming_load_loses_no_stream(
    servers: ServerUrls, unique: str, kind: str, tmp_path: Path
) -> None:
    model = f"m-{unique}"
    ids = [f"a-{unique}", f"b-{unique}"]
    spec = serving(model, "v1", max_concurrency=32, failover=FailoverPolicy(drain_timeout_s=0.5))
    request_ids = [f"s{i}-{unique}" for i in range(STREAMS)]
    async with (
        toys((model, "v1"), (model, "v1")) as started,
        aiohttp.ClientSession() as session,
        lanes_client(servers) as lanes,
        router_in_process(servers) as (_runner, url),
    ):
        toy_of = dict(zip(ids, started, strict=True))
        for at, (replica_id, toy) in enumerate(toy_of.items()):
            await announce_replica(lanes, replica_id, spec, toy.endpoint, node=f"n{at}-{unique}")
            await running_replica(lanes, replica_id, toy, f"n{at}-{unique}")
        await wait_routable(session, url, model, 2)
        for toy in started:
            await toy.control(tokens=TOKENS, token_delay_ms=30)
        progress: dict[str, int] = {}
        streams = [asyncio.create_task(stream(session, url, model, rid, progress)) for rid in request_ids]

        async def every_stream_started() -> bool:
            return all(progress.get(rid, 0) >= 2 for rid in request_ids)  # past their first tokens

        await eventually(every_stream_started, what="every stream's first tokens")
        in_flight = {replica_id: (await toy.stats())["in_flight"] for replica_id, toy in toy_of.items()}
        victim = max(in_flight, key=lambda replica_id: in_flight[replica_id])
        survivor = next(replica_id for replica_id in ids if replica_id != victim)
        assert in_flight[victim] >= 1
        if kind == "replica-drain":  # through a drill plan, which names no rank for a replica
            plan = tmp_path / "drills.yaml"
            plan.write_text(f"drills:\n  - {{job: {victim}, kind: {kind}}}\n")
            args: tuple[str, ...] = ("--plan", str(plan))
        else:
            args = (victim, "--kind", kind, *CASES[kind])
        drilled = await run_lanes_async(servers, "drill", *args, "--timeout", "60", "--json")
        assert drilled.returncode == 0, drilled.stderr
        cut = dict(zip(request_ids, await asyncio.wait_for(asyncio.gather(*streams), 60), strict=True))
        # The same requests again, never cut: the answers the clients should have had (the toy's answer is a
        # pure function of the request, whichever replica gives it).
        await toy_of[survivor].control(token_delay_ms=0)
        uncut: dict[str, bytes] = {}
        for rid in request_ids:
            status, _, body = await chat(
                session, url, model, stream=True, headers={"X-Request-Id": rid}, stream_options=USAGE
            )
            assert status == 200, body
            uncut[rid] = body
        events = await wait_served(lanes, model, 2 * STREAMS)
        timeline = await run_lanes_async(servers, "timeline", victim, "--json")
    assert_no_stream_lost(cut, uncut, events, (victim, survivor))
    (report,) = json.loads(drilled.stdout)["drills"]
    assert (report["kind"], report["replica"], report["lost"], report["errored"]) == (kind, victim, False, [])
    assert set(report["continued"]) <= set(report["in_flight"]) <= set(request_ids)
    assert report["continued"]
    assert report["took_over"] == [survivor]
    assert timeline.returncode == 0, timeline.stderr
    rows = json.loads(timeline.stdout)["timeline"]
    (injected,) = [row for row in rows if row["type"] == "io.lanes.job.drill_injected.v1"]
    assert injected["data"]["kind"] == kind


def assert_no_stream_lost(
    cut: dict[str, tuple[str, bytes]], uncut: dict[str, bytes], events: list[RequestServed], pair: tuple[str, str]
) -> None:
    """Every drilled stream is its uncut answer under its one request id; the moved ones name both replicas."""
    victim, survivor = pair
    request_ids = list(cut)
    for rid, (said_id, body) in cut.items():
        assert said_id == rid
        assert body == uncut[rid], rid  # byte for byte: no token lost or doubled, one completion id
        chunks = sse_events(body)
        assert chunks[-1] == "[DONE]"
        assert {chunk["id"] for chunk in chunks[:-1]} == {chunks[0]["id"]}
    first_of: dict[str, RequestServedData] = {}
    for event in events:
        first_of.setdefault(event.data.request_id, event.data)  # the drilled run was stored before the uncut one
    moved = [first_of[rid] for rid in request_ids if first_of[rid].continuations]
    assert moved, "the drill cut streams in flight: some must have moved"
    for data in moved:
        assert data.status == "ok", data.error
        assert [a.replica for a in data.attempts] == [victim, survivor]  # provenance names both replicas
        left, took_over = data.attempts
        assert left.outcome == "failed_mid_stream"
        assert left.tokens_sent is not None
        assert 2 <= left.tokens_sent < TOKENS
        assert took_over.first_token == left.tokens_sent  # the token index of the move
