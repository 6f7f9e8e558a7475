"""Streams that survive a replica: a toy replica process killed mid-stream under streaming load, and every
client still gets the answer it would have had, byte for byte, under one request id (issue 44)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict
from support.router import (
    announce_replica,
    chat,
    lanes_client,
    preferred_replica,
    router_in_process,
    serving,
    sse_events,
    toys,
    wait_routable,
    wait_served,
)
from support.waiting import eventually

from lanes_contract.events import (
    NodeStateChanged,
    NodeStateChangedData,
    ReplicaState,
    ReplicaStateChanged,
    ReplicaStateChangedData,
    RequestServed,
)
from lanes_contract.jobs import FailoverPolicy
from lanes_contract.topology import NodeState
from lanes_runtime.settings import ServerUrls

pytestmark = pytest.mark.real_servers

TOKENS = 60
STREAMS = 8
USAGE = {"include_usage": True}


async def stream_chat(
    session: aiohttp.ClientSession, url: str, model: str, request_id: str, progress: dict[str, int]
) -> tuple[CIMultiDict[str], bytes]:
    """One streaming chat, read as it arrives: `progress` counts the whole events received so far."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello there"}],
        "stream": True,
        "stream_options": USAGE,
    }
    return await stream_body(session, url, body, request_id, progress)


async def stream_body(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], request_id: str, progress: dict[str, int]
) -> tuple[CIMultiDict[str], bytes]:
    """Stream one chat request's answer, counting in `progress` the whole events received so far."""
    async with session.post(f"{url}/v1/chat/completions", json=body, headers={"X-Request-Id": request_id}) as r:
        assert r.status == 200, await r.text()
        received = b""
        async for chunk in r.content.iter_any():
            received += chunk
            progress[request_id] = received.count(b"\n\n")
        return CIMultiDict(r.headers), received


def _text(body: bytes) -> str:
    return "".join(e["choices"][0]["delta"]["content"] for e in sse_events(body)[:-1] if e["choices"])


def assert_one_whole_stream(request_id: str, headers: CIMultiDict[str], body: bytes, uncut: bytes) -> None:
    """The client's stream is the uncut one byte for byte, under one request id and one completion id."""
    assert body == uncut, request_id
    assert headers["X-Request-Id"] == request_id
    chunks = sse_events(body)
    assert chunks[-1] == "[DONE]"
    assert {chunk["id"] for chunk in chunks[:-1]} == {chunks[0]["id"]}
    assert _text(body) == "".join(f"tok{i} " for i in range(TOKENS))  # no token lost or doubled
    assert chunks[-2]["usage"]["completion_tokens"] == TOKENS


@dataclass(frozen=True)
class _Pair:
    """Two replicas of one model, the prompt every test streams, and which replica that prompt goes to first."""

    model: str
    ids: list[str]
    prompt: str
    first: str
    other: str


def _pair(unique: str) -> _Pair:
    ids = [f"a-{unique}", f"b-{unique}"]
    prompt = f"system prompt {unique}"
    first = preferred_replica(ids, prompt)  # with prefix affinity, the replica this prompt is sent to
    return _Pair(f"m-{unique}", ids, prompt, first, next(r for r in ids if r != first))


@pytest.mark.slow
async def test_streams_cut_by_a_killed_replica_continue_on_the_other_byte_for_byte(
    servers: ServerUrls, unique: str
) -> None:
    model = f"m-{unique}"
    ids = [f"a-{unique}", f"b-{unique}"]
    spec = serving(model, "v1", max_concurrency=32)
    request_ids = [f"s{i}-{unique}" for i in range(STREAMS)]
    async with (
        toys((model, "v1"), (model, "v1")) as started,
        aiohttp.ClientSession() as session,
        lanes_client(servers) as lanes,
        router_in_process(servers) as (_runner, url),
    ):
        toy_of = dict(zip(ids, started, strict=True))
        for replica_id, toy in toy_of.items():
            await announce_replica(lanes, replica_id, spec, toy.endpoint)
        await wait_routable(session, url, model, 2)
        for toy in started:
            await toy.control(tokens=TOKENS, token_delay_ms=30)
        progress: dict[str, int] = {}
        streams = [asyncio.create_task(stream_chat(session, url, model, rid, progress)) for rid in request_ids]

        async def every_stream_started() -> bool:
            return all(progress.get(rid, 0) >= 2 for rid in request_ids)  # two tokens in

        await eventually(every_stream_started, what="every stream's first tokens")
        in_flight = {replica_id: (await toy.stats())["in_flight"] for replica_id, toy in toy_of.items()}
        victim = max(in_flight, key=lambda replica_id: in_flight[replica_id])
        survivor = next(replica_id for replica_id in ids if replica_id != victim)
        assert in_flight[victim] >= 1
        toy_of[victim].kill()  # SIGKILL of the replica's process, streams in flight
        cut = dict(zip(request_ids, await asyncio.wait_for(asyncio.gather(*streams), 60), strict=True))
        # The same requests again, never cut (only the survivor is left): the answers the clients should have.
        await toy_of[survivor].control(token_delay_ms=0)
        uncut: dict[str, bytes] = {}
        for rid in request_ids:
            status, _, body = await chat(
                session, url, model, stream=True, headers={"X-Request-Id": rid}, stream_options=USAGE
            )
            assert status == 200, body
            uncut[rid] = body
        events = await wait_served(lanes, model, 2 * STREAMS)
    for rid, (headers, body) in cut.items():
        assert_one_whole_stream(rid, headers, body, uncut[rid])
    first_of: dict[str, RequestServed] = {}
    for event in events:
        first_of.setdefault(event.data.request_id, event)  # the cut run was stored before the uncut one
    moved = [first_of[rid] for rid in request_ids if first_of[rid].data.continuations]
    assert moved, "the killed replica had streams in flight: some must have moved"
    for rid in request_ids:
        data = first_of[rid].data
        assert data.status == "ok", data.error
        assert data.completion_tokens == TOKENS
    for event in moved:
        data = event.data
        left, took_over = data.attempts
        assert (left.replica, left.outcome, left.first_token) == (victim, "failed_mid_stream", 0)
        assert (took_over.replica, took_over.outcome) == (survivor, "ok")
        assert left.tokens_sent is not None
        assert 2 <= left.tokens_sent < TOKENS  # it had sent its first tokens
        assert took_over.first_token == left.tokens_sent  # the index where the stream moved
        assert took_over.tokens_sent == TOKENS - left.tokens_sent
        assert data.continuations == 1
        assert data.replica == survivor
    for event in first_of.values():
        if not event.data.continuations:
            (only,) = event.data.attempts
            assert (only.replica, only.outcome, only.first_token, only.tokens_sent) == (survivor, "ok", 0, TOKENS)


@pytest.mark.slow
async def test_a_model_that_cannot_continue_still_ends_its_stream_with_a_clear_error(
    servers: ServerUrls, unique: str
) -> None:
    model = f"m-{unique}"
    spec = serving(model, "v1", continuation="none")
    async with (
        toys((model, "v1"), (model, "v1")) as started,
        aiohttp.ClientSession() as session,
        lanes_client(servers) as lanes,
        router_in_process(servers) as (_runner, url),
    ):
        for i, toy in enumerate(started):
            await announce_replica(lanes, f"r{i}-{unique}", spec, toy.endpoint)
            await toy.control(mode="die_after", after_tokens=3)
        await wait_routable(session, url, model, 2)
        status, _, body = await chat(session, url, model, stream=True, headers={"X-Request-Id": f"cut-{unique}"})
        assert status == 200
        chunks = sse_events(body)
        assert [c["choices"][0]["delta"]["content"] for c in chunks[:3]] == ["tok0 ", "tok1 ", "tok2 "]
        error = chunks[3]["error"]
        assert (error["type"], error["code"]) == ("upstream_failed", 502)
        assert "failed mid-stream" in error["message"]
        assert chunks[4:] == ["[DONE]"]
        (event,) = await wait_served(lanes, model, 1)
    assert event.data.status == "failed"
    assert [a.outcome for a in event.data.attempts] == ["failed_mid_stream"]
    assert event.data.continuations == 0


@pytest.mark.slow
async def test_a_stream_moves_while_a_replica_is_left_and_its_record_says_where(
    servers: ServerUrls, unique: str
) -> None:
    model = f"m-{unique}"
    spec = serving(model, "v1")
    async with (
        toys((model, "v1"), (model, "v1")) as started,
        aiohttp.ClientSession() as session,
        lanes_client(servers) as lanes,
        router_in_process(servers) as (_runner, url),
    ):
        ids = [f"r{i}-{unique}" for i in range(2)]
        for replica_id, toy in zip(ids, started, strict=True):
            await announce_replica(lanes, replica_id, spec, toy.endpoint)
        await wait_routable(session, url, model, 2)
        # Both replicas drop the connection after 3 tokens: the stream moves once (its spec allows 2),
        # then again, and the third cut has nowhere left to go.
        for toy in started:
            await toy.control(mode="die_after", after_tokens=3, tokens=20)
        status, _, body = await chat(session, url, model, stream=True, headers={"X-Request-Id": f"two-{unique}"})
        assert status == 200
        chunks = sse_events(body)
        texts = [c["choices"][0]["delta"]["content"] for c in chunks if isinstance(c, dict) and "choices" in c]
        assert texts == [f"tok{i} " for i in range(6)]
        assert "no other replica could continue it" in chunks[6]["error"]["message"]
        (event,) = await wait_served(lanes, model, 1)
    data = event.data
    assert [(a.outcome, a.first_token, a.tokens_sent) for a in data.attempts] == [
        ("failed_mid_stream", 0, 3),
        ("failed_mid_stream", 3, 3),
    ]
    assert {a.replica for a in data.attempts} == set(ids)
    assert data.continuations == 1
    assert data.status == "failed"
    assert data.completion_tokens == 6  # three tokens from each replica


@pytest.mark.slow
async def test_a_stream_whose_replica_goes_silent_moves_when_the_idle_timeout_says_so(
    servers: ServerUrls, unique: str
) -> None:
    pair = _pair(unique)
    model, ids, prompt, silent, other = pair.model, pair.ids, pair.prompt, pair.first, pair.other
    async with (
        toys((model, "v1"), (model, "v1")) as started,
        aiohttp.ClientSession() as session,
        lanes_client(servers) as lanes,
        router_in_process(servers, prefix_affinity=True) as (_runner, url),
    ):
        toy_of = dict(zip(ids, started, strict=True))
        for replica_id, toy in toy_of.items():
            await announce_replica(lanes, replica_id, serving(model, "v1"), toy.endpoint)
        await wait_routable(session, url, model, 2)
        # The replica affinity picks first sends 3 tokens, then nothing, its connection open (a hung node).
        await toy_of[silent].control(mode="stall_after", after_tokens=3)
        messages = [{"role": "user", "content": prompt}]
        status, _, body = await chat(
            session, url, model, stream=True, messages=messages, headers={"X-Request-Id": f"quiet-{unique}"}
        )
        assert status == 200
        assert _text(body) == "".join(f"tok{i} " for i in range(8))
        assert all("error" not in chunk for chunk in sse_events(body)[:-1])
        (event,) = await wait_served(lanes, model, 1)
    left, took_over = event.data.attempts
    assert (left.replica, left.outcome, left.first_token, left.tokens_sent) == (silent, "failed_mid_stream", 0, 3)
    assert left.detail  # why it moved: the read timeout of a silent replica
    assert (took_over.replica, took_over.outcome, took_over.first_token, took_over.tokens_sent) == (other, "ok", 3, 5)
    assert event.data.status == "ok"


@pytest.mark.slow
async def test_streams_on_a_lost_node_move_at_once_not_at_the_idle_timeout(servers: ServerUrls, unique: str) -> None:
    pair = _pair(unique)
    model, ids, prompt, lost, other = pair.model, pair.ids, pair.prompt, pair.first, pair.other
    nodes = dict(zip(ids, (f"n-a-{unique}", f"n-b-{unique}"), strict=True))
    request_id = f"lost-{unique}"
    # An idle timeout far beyond the test's wait: only the node's loss can move the stream in time.
    async with (
        toys((model, "v1"), (model, "v1")) as started,
        aiohttp.ClientSession() as session,
        lanes_client(servers) as lanes,
        router_in_process(servers, prefix_affinity=True, stream_idle_timeout_s=600) as (_runner, url),
    ):
        toy_of = dict(zip(ids, started, strict=True))
        for replica_id, toy in toy_of.items():
            await announce_replica(lanes, replica_id, serving(model, "v1"), toy.endpoint, node=nodes[replica_id])
        await wait_routable(session, url, model, 2)
        await toy_of[lost].control(mode="stall_after", after_tokens=3)
        progress: dict[str, int] = {}
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True}
        stream = asyncio.create_task(stream_body(session, url, body, request_id, progress))

        async def three_tokens_in() -> bool:
            return progress.get(request_id, 0) >= 3

        await eventually(three_tokens_in, what="the stream's first three tokens")
        data = NodeStateChangedData(state=NodeState.UNHEALTHY, reason="Xid 79: GPU has fallen off the bus")
        await lanes.publish(NodeStateChanged(source="tests", node=nodes[lost], data=data))
        _, received = await asyncio.wait_for(stream, 60)
        (event,) = await wait_served(lanes, model, 1)
    assert _text(received) == "".join(f"tok{i} " for i in range(8))
    left, took_over = event.data.attempts
    assert (left.replica, left.outcome, left.tokens_sent) == (lost, "failed_mid_stream", 3)
    assert f"its node {nodes[lost]} is unhealthy" in left.detail
    assert (took_over.replica, took_over.outcome, took_over.first_token) == (other, "ok", 3)


@pytest.mark.slow
async def test_a_drained_replica_hands_its_streams_over_after_the_drain_timeout(
    servers: ServerUrls, unique: str
) -> None:
    pair = _pair(unique)
    model, ids, prompt, drained, other = pair.model, pair.ids, pair.prompt, pair.first, pair.other
    request_id = f"drain-{unique}"
    spec = serving(model, "v1", failover=FailoverPolicy(drain_timeout_s=0.5))
    async with (
        toys((model, "v1"), (model, "v1")) as started,
        aiohttp.ClientSession() as session,
        lanes_client(servers) as lanes,
        router_in_process(servers, prefix_affinity=True, stream_idle_timeout_s=600) as (_runner, url),
    ):
        toy_of = dict(zip(ids, started, strict=True))
        for replica_id, toy in toy_of.items():
            await announce_replica(lanes, replica_id, spec, toy.endpoint)
        await wait_routable(session, url, model, 2)
        # A long answer from the replica that is about to drain: it would still be sending for a minute.
        await toy_of[drained].control(tokens=600, token_delay_ms=100)
        await toy_of[other].control(tokens=600)
        progress: dict[str, int] = {}
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True}
        stream = asyncio.create_task(stream_body(session, url, body, request_id, progress))

        async def three_tokens_in() -> bool:
            return progress.get(request_id, 0) >= 3

        await eventually(three_tokens_in, what="the stream's first three tokens")
        data = ReplicaStateChangedData(
            replica=drained, model=model, version="v1", state=ReplicaState.DRAINING, signal="operator"
        )
        await lanes.publish(ReplicaStateChanged(source="tests", jobid=drained, data=data))
        _, received = await asyncio.wait_for(stream, 60)
        (event,) = await wait_served(lanes, model, 1)
    assert _text(received) == "".join(f"tok{i} " for i in range(600))
    left, took_over = event.data.attempts
    assert (left.replica, left.outcome) == (drained, "failed_mid_stream")
    assert "drained for 0.5s" in left.detail
    assert left.tokens_sent is not None
    assert 3 <= left.tokens_sent < 600
    assert (took_over.replica, took_over.outcome, took_over.first_token) == (other, "ok", left.tokens_sent)


@pytest.mark.slow
async def test_a_deployment_that_asks_for_connect_failures_gets_them_not_another_replica(
    servers: ServerUrls, unique: str
) -> None:
    pair = _pair(unique)
    model, ids, prompt, dead = pair.model, pair.ids, pair.prompt, pair.first
    spec = serving(model, "v1", failover=FailoverPolicy(connect_failure="fail"))
    async with (
        toys((model, "v1"), (model, "v1")) as started,
        aiohttp.ClientSession() as session,
        lanes_client(servers) as lanes,
        router_in_process(servers, prefix_affinity=True) as (_runner, url),
    ):
        toy_of = dict(zip(ids, started, strict=True))
        for replica_id, toy in toy_of.items():
            await announce_replica(lanes, replica_id, spec, toy.endpoint)
        await wait_routable(session, url, model, 2)
        toy_of[dead].kill()
        messages = [{"role": "user", "content": prompt}]
        status, _, body = await chat(session, url, model, messages=messages, headers={"X-Request-Id": f"c-{unique}"})
        (event,) = await wait_served(lanes, model, 1)
    assert status == 502, body
    assert [(a.replica, a.outcome) for a in event.data.attempts] == [(dead, "refused")]
