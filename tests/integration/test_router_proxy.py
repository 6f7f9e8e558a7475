"""The router's HTTP front on real replicas, NATS and Redis: routing, version pins, failover, mid-stream errors,
protection modes, provenance."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from support.router import (
    announce_replica,
    chat,
    end_job,
    lanes_client,
    preferred_replica,
    routed_replica,
    router_in_process,
    served_events,
    serving,
    sse_events,
    toys,
    wait_routable,
    wait_served,
)
from support.waiting import eventually

from lanes_contract.events import ReplicaState, ReplicaStateChanged, ReplicaStateChangedData
from lanes_contract.jobs import JobState
from lanes_runtime.settings import ServerUrls

pytestmark = pytest.mark.real_servers


def _fingerprint(body: bytes) -> str:
    return str(json.loads(body)["system_fingerprint"])


@pytest.mark.slow
async def test_requests_are_served_streaming_and_not_with_one_provenance_event_each(
    servers: ServerUrls, unique: str
) -> None:
    model = f"m-{unique}"
    spec = serving(model, "v1")
    async with routed_replica(servers, f"r1-{unique}", spec, node="node-7", gpus=(3,)) as routed:
        session, lanes, url = routed.session, routed.lanes, routed.url
        status, headers, body = await chat(session, url, model, headers={"X-Request-Id": f"plain-{unique}"})
        assert status == 200, body
        assert headers["X-Lanes-Replica"] == f"r1-{unique}"
        assert json.loads(body)["choices"][0]["message"]["content"].startswith("tok0")
        status, _, body = await chat(
            session,
            url,
            model,
            stream=True,
            headers={"X-Request-Id": f"stream-{unique}"},
            stream_options={"include_usage": True},
        )
        assert status == 200, body
        events = sse_events(body)
        assert events[-1] == "[DONE]"
        assert "".join(e["choices"][0]["delta"]["content"] for e in events[:-2]).startswith("tok0 tok1")
        served = {e.data.request_id: e for e in await wait_served(lanes, model, 2)}
    assert set(served) == {f"plain-{unique}", f"stream-{unique}"}
    for event in served.values():
        assert event.nats_subject() == f"lanes.req.{model}.r1-{unique}"
        assert (event.jobid, event.attempt, event.node) == (f"r1-{unique}", 1, "node-7")
        assert event.data.status == "ok"
        assert event.data.version == "v1"
        assert event.data.gpus == (3,)
        assert event.data.completion_tokens == 8
        assert event.data.prompt_tokens == 2
        assert event.data.ttft_ms is not None
        assert [a.outcome for a in event.data.attempts] == ["ok"]
    assert served[f"stream-{unique}"].data.stream


@pytest.mark.slow
async def test_a_pinned_version_never_goes_to_another_version(servers: ServerUrls, unique: str) -> None:
    model = f"m-{unique}"
    async with (
        toys((model, "v1"), (model, "v1"), (model, "v2")) as (old_a, old_b, new),
        aiohttp.ClientSession() as session,
        lanes_client(servers) as lanes,
        router_in_process(servers) as (_runner, url),
    ):
        await announce_replica(lanes, f"a-{unique}", serving(model, "v1"), old_a.endpoint)
        await announce_replica(lanes, f"b-{unique}", serving(model, "v1"), old_b.endpoint)
        # The canary has weight 0: unpinned traffic never reaches it, pinned traffic only reaches it.
        await announce_replica(lanes, f"c-{unique}", serving(model, "v2", weight=0), new.endpoint)
        await wait_routable(session, url, model, 3)
        for _ in range(20):
            status, _, body = await chat(session, url, model, headers={"X-Lanes-Model-Version": "v2"})
            assert status == 200, body
            assert _fingerprint(body).startswith(f"{model}@v2")
            status, _, body = await chat(session, url, f"{model}@v2")
            assert status == 200, body
            assert _fingerprint(body).startswith(f"{model}@v2")
            status, _, body = await chat(session, url, model)
            assert status == 200, body
            assert _fingerprint(body).startswith(f"{model}@v1")
        # The only v2 replica fails: pinned requests get the protection answer, never a v1 replica.
        new.kill()
        statuses = set()
        for _ in range(6):
            status, headers, body = await chat(session, url, model, headers={"X-Lanes-Model-Version": "v2"})
            assert status != 200 or _fingerprint(body).startswith(f"{model}@v2")
            statuses.add(status)
        status, headers, body = await chat(session, url, model, headers={"X-Lanes-Model-Version": "v2"})
        assert status == 503, body
        assert headers["Retry-After"] == "2"
        assert json.loads(body)["error"]["type"] == "overloaded"
        assert statuses <= {502, 503}
        events = await wait_served(lanes, model, 67)
    pinned_to_v2 = [e for e in events if e.data.version == "v2"]
    assert all(a.replica == f"c-{unique}" for e in pinned_to_v2 for a in e.data.attempts)


@pytest.mark.slow
async def test_a_client_that_hangs_up_before_a_slow_answer_is_recorded_as_client_closed(
    servers: ServerUrls, unique: str
) -> None:
    model = f"m-{unique}"
    async with routed_replica(servers, f"r1-{unique}", serving(model, "v1")) as routed:
        lanes, url = routed.lanes, routed.url
        await routed.toy.control(token_delay_ms=300)
        # 8 tokens x 300 ms: the client gives up long before the replica's whole answer is ready.
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as impatient:
            with pytest.raises(TimeoutError):
                await chat(impatient, url, model, headers={"X-Request-Id": f"gone-{unique}"})
        (event,) = await wait_served(lanes, model, 1)
    assert event.data.request_id == f"gone-{unique}"
    assert event.data.status == "client_closed"


@pytest.mark.slow
async def test_failover_before_the_first_byte_is_invisible_to_the_client(servers: ServerUrls, unique: str) -> None:
    model = f"m-{unique}"
    ids = [f"a-{unique}", f"b-{unique}"]
    prompt = f"system prompt {unique}"
    first = preferred_replica(ids, prompt)
    messages = [{"role": "user", "content": prompt}]
    async with toys((model, "v1"), (model, "v1")) as started, aiohttp.ClientSession() as session:
        toy_of = dict(zip(ids, started, strict=True))
        async with lanes_client(servers) as lanes, router_in_process(servers, prefix_affinity=True) as (_r, url):
            for replica_id, toy in toy_of.items():
                await announce_replica(lanes, replica_id, serving(model, "v1"), toy.endpoint)
            await wait_routable(session, url, model, 2)
            # The replica affinity tries first answers 500: the client still gets one clean answer.
            await toy_of[first].control(mode="fail")
            status, headers, body = await chat(
                session, url, model, messages=messages, headers={"X-Request-Id": f"fail-{unique}"}
            )
            assert status == 200, body
            assert headers["X-Lanes-Replica"] != first
            assert json.loads(body)["choices"][0]["message"]["content"].startswith("tok0")
            # A streaming request whose first choice is dead (connection refused) streams from the other one.
            toy_of[first].kill()
            status, headers, body = await chat(
                session, url, model, stream=True, messages=messages, headers={"X-Request-Id": f"dead-{unique}"}
            )
            assert status == 200, body
            events = sse_events(body)
            assert events[-1] == "[DONE]"
            assert all("error" not in e for e in events[:-1])
            served = {e.data.request_id: e for e in await wait_served(lanes, model, 2)}
    failed_over = served[f"fail-{unique}"]
    assert [(a.replica, a.outcome, a.http_status) for a in failed_over.data.attempts] == [
        (first, "error", 500),
        (headers["X-Lanes-Replica"], "ok", 200),
    ]
    assert failed_over.data.status == "ok"
    assert failed_over.data.replica == headers["X-Lanes-Replica"]
    dead = served[f"dead-{unique}"]
    assert dead.data.status == "ok"
    assert dead.data.attempts[-1].outcome == "ok"
    assert all(a.outcome == "refused" for a in dead.data.attempts[:-1])


@pytest.mark.slow
async def test_a_replica_failing_mid_stream_ends_the_stream_with_a_clear_error(
    servers: ServerUrls, unique: str
) -> None:
    model = f"m-{unique}"
    async with routed_replica(servers, f"r-{unique}", serving(model, "v1")) as routed:
        session, lanes, url = routed.session, routed.lanes, routed.url
        await routed.toy.control(mode="die_after", after_tokens=3)
        status, _, body = await chat(session, url, model, stream=True, headers={"X-Request-Id": f"mid-{unique}"})
        assert status == 200
        events = sse_events(body)
        assert [e["choices"][0]["delta"]["content"] for e in events[:3]] == ["tok0 ", "tok1 ", "tok2 "]
        error = events[3]["error"]
        assert error["type"] == "upstream_failed"
        assert error["code"] == 502
        assert f"r-{unique}" in error["message"]
        assert events[4:] == ["[DONE]"]
        (event,) = await wait_served(lanes, model, 1)
    assert event.data.status == "failed"
    assert [a.outcome for a in event.data.attempts] == ["failed_mid_stream"]
    assert event.data.completion_tokens == 3


@pytest.mark.parametrize(
    ("protection", "expected_status", "error_type"),
    [("pause", 503, "overloaded"), ("reject", 429, "rate_limited"), ("queue", 503, "overloaded")],
)
@pytest.mark.slow
async def test_each_protection_mode_answers_as_specified_when_no_replica_has_room(
    servers: ServerUrls, unique: str, protection: str, expected_status: int, error_type: str
) -> None:
    model = f"m-{unique}"
    spec = serving(model, "v1", max_concurrency=1, protection=protection, queue_timeout_s=1.0, retry_after_s=7)
    async with routed_replica(servers, f"r-{unique}", spec) as routed:
        session, lanes, url, toy = routed.session, routed.lanes, routed.url, routed.toy
        # The only slot is held until the test lets it go: a fixed delay raced the second request on a busy
        # machine (the holder finished first, and the second request was served).
        await toy.control(first_token_delay_ms=600_000)
        holder = asyncio.create_task(chat(session, url, model))

        async def slot_taken() -> bool:
            return bool((await toy.stats())["in_flight"] == 1)

        await eventually(slot_taken, what="the only slot to be taken")
        status, headers, body = await chat(session, url, model)
        await toy.control(first_token_delay_ms=0)  # the holder's first token goes now
        assert status == expected_status, body
        assert headers["Retry-After"] == "7"
        error = json.loads(body)["error"]
        assert error["type"] == error_type
        assert error["code"] == expected_status
        if protection == "queue":
            assert "queue" in error["message"]
            assert (await holder)[0] == 200
            # A queued request that gets a slot within its bound is served.
            await toy.control(first_token_delay_ms=300)
            holder = asyncio.create_task(chat(session, url, model))
            await eventually(slot_taken, what="the only slot to be taken again")
            queued = asyncio.create_task(chat(session, url, model))
            assert (await holder)[0] == 200
            assert (await queued)[0] == 200
        else:
            assert (await holder)[0] == 200
        events = await wait_served(lanes, model, 4 if protection == "queue" else 2)
    rejected = [e for e in events if e.data.status == "rejected"]
    assert len(rejected) == 1
    assert rejected[0].nats_subject() == f"lanes.req.{model}.unrouted"
    assert rejected[0].jobid is None
    assert rejected[0].data.http_status == expected_status


@pytest.mark.slow
async def test_no_ready_replica_gets_the_protection_answer_and_bad_input_a_400(
    servers: ServerUrls, unique: str
) -> None:
    model = f"m-{unique}"
    async with (
        toys((model, "v1")) as (toy,),
        aiohttp.ClientSession() as session,
        lanes_client(servers) as lanes,
        router_in_process(servers) as (_runner, url),
    ):
        await toy.control(health="fail")
        await announce_replica(lanes, f"r-{unique}", serving(model, "v1", protection="reject"), toy.endpoint)

        async def known() -> bool:
            async with session.get(f"{url}/v1/models") as response:
                return model in {m["id"] for m in (await response.json())["data"]}

        await eventually(known, what="the replica to be registered")
        status, _, body = await chat(session, url, model)
        assert status == 429, body  # starting, never passed a health check: not routable
        assert "no ready replica" in json.loads(body)["error"]["message"]
        status, _, body = await chat(session, url, f"nope-{unique}")
        assert status == 404
        assert json.loads(body)["error"]["type"] == "model_not_found"
        for payload in (
            b"{not json",
            b"[]",
            b'{"messages": []}',
            b'{"model": "a.b"}',
            b'{"model": "m", "stream": 1}',
        ):
            async with session.post(f"{url}/v1/chat/completions", data=payload) as response:
                assert response.status == 400
                error = (await response.json())["error"]
                assert error["type"] == "invalid_request_error"
                assert error["message"]
        status, _, body = await chat(session, url, f"{model}@v1", headers={"X-Lanes-Model-Version": "v2"})
        assert status == 400
        async with session.get(f"{url}/healthz") as response:
            assert response.status == 200
        async with session.get(f"{url}/readyz") as response:
            assert response.status == 200
        events = await wait_served(lanes, model, 1)
        async with session.get(f"{url}/metrics") as response:
            metrics = await response.text()
        assert f'lanes_router_requests_total{{model="{model}",status="rejected",code="429"}} 1' in metrics
        assert "request_id" not in metrics
        # Made-up model names are counted under one label and leave no event: they cannot grow either.
        for name in (f"made-up-{i}-{unique}" for i in range(20)):
            assert (await chat(session, url, name))[0] == 404
        async with session.get(f"{url}/metrics") as response:
            metrics = await response.text()
        assert 'lanes_router_requests_total{model="(not served)",status="rejected",code="404"} 21' in metrics
        assert "nope-" not in metrics
        assert "made-up-" not in metrics
        # Bad input and unknown models never reach the log: the one event is the served model's. Events are
        # published in batches in request order, so once a request after them is recorded, all would be.
        status, _, _ = await chat(session, url, model)
        assert status == 429
        assert len(await wait_served(lanes, model, 2)) == len(events) + 1 == 2
        assert await served_events(lanes, f"nope-{unique}") == []


@pytest.mark.slow
async def test_draining_takes_no_new_requests_and_lets_in_flight_ones_finish(servers: ServerUrls, unique: str) -> None:
    model = f"m-{unique}"
    async with (
        toys((model, "v1"), (model, "v1")) as (toy_a, toy_b),
        aiohttp.ClientSession() as session,
        lanes_client(servers) as lanes,
        router_in_process(servers) as (_runner, url),
    ):
        await announce_replica(lanes, f"a-{unique}", serving(model, "v1"), toy_a.endpoint)
        await wait_routable(session, url, model, 1)
        await toy_a.control(token_delay_ms=150)
        in_flight = asyncio.create_task(chat(session, url, model, stream=True))

        async def streaming() -> bool:
            return bool((await toy_a.stats())["in_flight"] == 1)

        await eventually(streaming, what="the stream to start")
        await announce_replica(lanes, f"b-{unique}", serving(model, "v1"), toy_b.endpoint)
        await wait_routable(session, url, model, 2)
        drain = ReplicaStateChangedData(
            replica=f"a-{unique}", model=model, version="v1", state=ReplicaState.DRAINING, signal="operator"
        )
        await lanes.publish(ReplicaStateChanged(source="tests", jobid=f"a-{unique}", attempt=1, data=drain))
        await wait_routable(session, url, model, 1)
        for _ in range(10):
            status, headers, _ = await chat(session, url, model)
            assert (status, headers["X-Lanes-Replica"]) == (200, f"b-{unique}")
        status, _, body = await in_flight
        assert status == 200
        assert sse_events(body)[-1] == "[DONE]"
        assert all("error" not in e for e in sse_events(body)[:-1])
        # Scale-down: the job is cancelled; its replica leaves rotation for good.
        await end_job(lanes, f"b-{unique}", JobState.CANCELLED)

        async def b_gone() -> bool:
            status, _, _ = await chat(session, url, model)
            return status == 503

        await eventually(b_gone, what="the cancelled replica to leave rotation")


@pytest.mark.slow
async def test_one_provenance_event_per_request_including_retried_ones(servers: ServerUrls, unique: str) -> None:
    model = f"m-{unique}"
    ids = [f"a-{unique}", f"b-{unique}"]
    prompt = f"shared prefix {unique}"
    failing = preferred_replica(ids, prompt)
    messages = [{"role": "user", "content": prompt}]
    async with toys((model, "v1"), (model, "v1")) as started, aiohttp.ClientSession() as session:
        toy_of = dict(zip(ids, started, strict=True))
        async with lanes_client(servers) as lanes, router_in_process(servers, prefix_affinity=True) as (_r, url):
            for replica_id, toy in toy_of.items():
                await announce_replica(lanes, replica_id, serving(model, "v1", max_concurrency=64), toy.endpoint)
            await wait_routable(session, url, model, 2)
            await toy_of[failing].control(mode="fail", fail_status=502)
            answers = await asyncio.gather(
                *(
                    chat(session, url, model, stream=i % 2 == 0, messages=messages, headers={"X-Request-Id": f"q{i}"})
                    for i in range(30)
                )
            )
            assert [status for status, _, _ in answers] == [200] * 30, [b for s, _, b in answers if s != 200][:2]
            events = await wait_served(lanes, model, 30)
            await asyncio.sleep(0.5)  # anything published twice would be stored by now
            events = await served_events(lanes, model)
    ids_seen = [e.data.request_id for e in events]
    assert sorted(ids_seen) == sorted(f"q{i}" for i in range(30))
    retried = [e for e in events if len(e.data.attempts) > 1]
    assert retried
    for event in retried:
        assert event.data.attempts[0].replica == failing
        assert event.data.attempts[0].http_status == 502
        assert event.data.attempts[-1].outcome == "ok"
        assert event.data.replica != failing


@pytest.mark.slow
async def test_a_slow_first_token_moves_the_stream_to_another_replica(servers: ServerUrls, unique: str) -> None:
    model = f"m-{unique}"
    ids = [f"a-{unique}", f"b-{unique}"]
    prompt = f"slow prefix {unique}"
    slow = preferred_replica(ids, prompt)
    messages = [{"role": "user", "content": prompt}]
    async with (
        toys((model, "v1"), (model, "v1")) as started,
        aiohttp.ClientSession() as session,
        lanes_client(servers) as lanes,
        router_in_process(servers, prefix_affinity=True, first_token_timeout_s=0.5) as (_r, url),
    ):
        toy_of = dict(zip(ids, started, strict=True))
        for replica_id, toy in toy_of.items():
            await announce_replica(lanes, replica_id, serving(model, "v1"), toy.endpoint)
        await wait_routable(session, url, model, 2)
        await toy_of[slow].control(mode="hang")
        status, headers, body = await chat(session, url, model, stream=True, messages=messages)
        assert status == 200
        assert headers["X-Lanes-Replica"] != slow
        assert sse_events(body)[-1] == "[DONE]"
        (event,) = await wait_served(lanes, model, 1)
    assert [(a.replica, a.outcome) for a in event.data.attempts] == [
        (slow, "slow_first_token"),
        (event.data.replica, "ok"),
    ]
