"""Several router processes sharing one Redis: concurrency caps hold across them, a crashed one leaks no slot,
and a replica transition observed by two routers is published once."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from support.router import (
    announce_replica,
    chat,
    lanes_client,
    router_in_process,
    serving,
    start_router_process,
    toys,
    wait_routable,
)
from support.waiting import eventually

from lanes_contract.codec import decode
from lanes_contract.events import NodeRegistered, NodeRegisteredData, ReplicaState, ReplicaStateChanged
from lanes_router.adapters.leases import lease_key
from lanes_runtime.cache import connect_redis
from lanes_runtime.reader import Selection, iter_stream
from lanes_runtime.settings import ServerUrls

pytestmark = pytest.mark.real_servers


@pytest.mark.slow
async def test_the_concurrency_cap_holds_across_two_router_processes(servers: ServerUrls, unique: str) -> None:
    model = f"m-{unique}"
    spec = serving(model, "v1", max_concurrency=3, protection="queue", queue_timeout_s=30)
    routers = [start_router_process(servers), start_router_process(servers)]
    try:
        async with toys((model, "v1")) as (toy,), aiohttp.ClientSession() as session:
            async with lanes_client(servers) as lanes:
                await announce_replica(lanes, f"r-{unique}", spec, toy.endpoint)
            for router in routers:
                await wait_routable(session, router.url, model, 1)
            await toy.control(first_token_delay_ms=100, token_delay_ms=10)
            answers = await asyncio.gather(
                *(chat(session, routers[i % 2].url, model, stream=i % 3 == 0) for i in range(24))
            )
            assert [status for status, _, _ in answers] == [200] * 24
            stats = await toy.stats()
    finally:
        for router in routers:
            router.terminate()
    assert stats["requests"] == 24
    # The cap is 3, and with 24 requests queued on two routers it was reached, never passed.
    assert stats["max_in_flight"] == 3


@pytest.mark.slow
async def test_a_crashed_router_leaks_no_slots(servers: ServerUrls, unique: str) -> None:
    model = f"m-{unique}"
    replica = f"r-{unique}"
    spec = serving(model, "v1", max_concurrency=2, protection="reject")
    crashing = start_router_process(servers, lease_ttl_s=1.5)
    redis = await connect_redis(servers.redis_url)
    try:
        async with toys((model, "v1")) as (toy,), aiohttp.ClientSession() as session:
            async with lanes_client(servers) as lanes:
                await announce_replica(lanes, replica, spec, toy.endpoint)
            await wait_routable(session, crashing.url, model, 1)
            # Two long streams take both slots through the router that is about to die.
            await toy.control(tokens=1000, token_delay_ms=20)
            streams = [asyncio.create_task(chat(session, crashing.url, model, stream=True)) for _ in range(2)]

            async def both_slots_taken() -> bool:
                return bool(await redis.zcard(lease_key(replica)) == 2)

            await eventually(both_slots_taken, what="both slots to be leased")
            crashing.kill()  # SIGKILL: no release, no flush, no goodbye
            for stream in streams:
                with pytest.raises(aiohttp.ClientPayloadError):  # cut off with the router
                    await stream
            await toy.control(tokens=8, token_delay_ms=0)
            async with router_in_process(servers) as (_runner, url):
                await wait_routable(session, url, model, 1)

                async def slots_free_again() -> bool:
                    status, _, _ = await chat(session, url, model)
                    return status == 200

                # The dead router's leases are not renewed: they expire, and both slots can be used again.
                await eventually(slots_free_again, timeout_s=15, what="the crashed router's leases to expire")
                await toy.control(first_token_delay_ms=500)
                answers = await asyncio.gather(*(chat(session, url, model) for _ in range(2)))
                assert [status for status, _, _ in answers] == [200, 200]

                async def no_lease_left() -> bool:
                    return bool(await redis.zcard(lease_key(replica)) == 0)

                await eventually(no_lease_left, what="every lease to be released")
    finally:
        crashing.kill()
        await redis.aclose()


@pytest.mark.slow
async def test_two_routers_publish_a_replica_transition_once(servers: ServerUrls, unique: str) -> None:
    model = f"m-{unique}"
    replica = f"r-{unique}"
    async with (
        toys((model, "v1")) as (toy,),
        aiohttp.ClientSession() as session,
        lanes_client(servers) as lanes,
        router_in_process(servers) as (_first, url_a),
        router_in_process(servers) as (_second, url_b),
    ):
        await announce_replica(lanes, replica, serving(model, "v1"), toy.endpoint)
        await wait_routable(session, url_a, model, 1)
        await wait_routable(session, url_b, model, 1)
        toy.kill()
        for url in (url_a, url_b):
            await chat(session, url, model)

        async def both_see_it_unhealthy() -> bool:
            routable = []
            for url in (url_a, url_b):
                async with session.get(f"{url}/readyz") as response:
                    routable.append((await response.json())["routable"])
            return routable == [0, 0]

        await eventually(both_see_it_unhealthy, what="both routers to take the dead replica out")
        await asyncio.sleep(0.5)  # a second publish, if any, would be stored by now
        transitions = []
        async for msg in iter_stream(lanes.js, Selection("LANES_JOBS", f"lanes.job.{replica}.replica_state")):
            event = decode(msg.subject, msg.headers, msg.data)
            assert isinstance(event, ReplicaStateChanged)
            transitions.append((event.data.previous, event.data.state))
    assert transitions == [(ReplicaState.STARTING, ReplicaState.READY), (ReplicaState.READY, ReplicaState.UNHEALTHY)]


async def test_a_router_starts_on_a_log_with_no_event_it_reads(own_urls: ServerUrls, unique: str) -> None:
    # Node registrations do not match the router's filters: the replay must still count as done.
    async with lanes_client(own_urls) as lanes:
        await lanes.publish(
            NodeRegistered(
                source="tests", node=f"n-{unique}", data=NodeRegisteredData(gpu_model="H100", gpus=8, gpu_memory_gib=80)
            )
        )
    async with router_in_process(own_urls) as (runner, _url):
        assert runner.feed.caught_up.is_set()
