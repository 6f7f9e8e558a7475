"""The router under faults (issue 16): Redis killed or stopped under load, a slow-header flood, a pin to a
version that has no replica. Real router, real toy replicas, real NATS, and a Redis of the test's own that
the test kills or freezes (SIGSTOP)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from support.router import (
    announce_replica,
    chat,
    lanes_client,
    router_in_process,
    serving,
    toys,
    wait_routable,
    wait_served,
)
from support.waiting import eventually

from lanes_contract.jobs import ProtectionMode
from lanes_router.domain.tenants import key_hash
from lanes_router.entrypoints.runner import RouterRunner
from lanes_runtime.settings import ServerUrls
from lanes_sandbox.embedded import EmbeddedRedis

pytestmark = pytest.mark.real_servers

# Generous for a loaded 2-core machine, far below "hangs": a request that waited on a frozen Redis for ever
# (the reported fault) fails this bound, one answered within the router's 1 s shared-state timeout passes.
ANSWER_BOUND_S = 20


@contextlib.contextmanager
def own_redis(servers: ServerUrls) -> Iterator[tuple[EmbeddedRedis, ServerUrls]]:
    with EmbeddedRedis() as redis:
        yield redis, ServerUrls(servers.nats_url, servers.database_url, redis.url)


@contextlib.contextmanager
def frozen(redis: EmbeddedRedis) -> Iterator[None]:
    assert redis.pid is not None
    os.kill(redis.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(redis.pid, signal.SIGCONT)


@contextlib.asynccontextmanager
async def routed(
    urls: ServerUrls, unique: str, **router: object
) -> AsyncIterator[tuple[aiohttp.ClientSession, str, RouterRunner]]:
    model = f"m-{unique}"
    async with (
        toys((model, "v1")) as (toy,),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=ANSWER_BOUND_S)) as session,
        lanes_client(urls) as lanes,
        router_in_process(urls, **router) as (runner, url),
    ):
        spec = serving(model, "v1", protection=ProtectionMode.QUEUE, queue_timeout_s=120)
        await announce_replica(lanes, f"r-{unique}", spec, toy.endpoint)
        await wait_routable(session, url, model, 1)
        yield session, url, runner


async def readiness(session: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, object]]:
    async with session.get(f"{url}/readyz") as response:
        return response.status, await response.json()


async def test_redis_stopped_under_load_gives_503_with_retry_after_then_recovers(
    servers: ServerUrls, unique: str
) -> None:
    with own_redis(servers) as (redis, urls):
        async with routed(urls, unique) as (session, url, _):
            model = f"m-{unique}"
            assert (await chat(session, url, model))[0] == 200
            with frozen(redis):
                answers = await asyncio.gather(*(chat(session, url, model) for _ in range(20)))
                assert {status for status, _, _ in answers} == {503}
                for _, headers, body in answers:
                    assert headers["Retry-After"] == "2"
                    assert json.loads(body)["error"]["type"] == "shared_state_unavailable"
                status, ready = await readiness(session, url)
                assert (status, ready["ready"], ready["shared_state"]) == (503, False, False)

            async def back() -> bool:
                return (await readiness(session, url))[0] == 200 and (await chat(session, url, model))[0] == 200

            await eventually(back, timeout_s=30, what="the router to be ready and serving again")


async def test_redis_killed_under_load_gives_503_not_500(servers: ServerUrls, unique: str) -> None:
    with own_redis(servers) as (redis, urls):
        async with routed(urls, unique) as (session, url, _):
            model = f"m-{unique}"
            assert (await chat(session, url, model))[0] == 200
            assert redis.pid is not None
            os.kill(redis.pid, signal.SIGKILL)
            answers = await asyncio.gather(*(chat(session, url, model) for _ in range(20)))
            assert {status for status, _, _ in answers} == {503}
            assert all(headers.get("Retry-After") == "2" for _, headers, _ in answers)
            status, body = await readiness(session, url)
            assert (status, body["shared_state"]) == (503, False)


async def test_a_pin_to_a_version_with_no_replica_answers_at_once(servers: ServerUrls, unique: str) -> None:
    """The deployment queues for 120 s; a pin to a version nobody runs must not wait for that."""
    async with routed(servers, unique) as (session, url, _):
        status, _, body = await chat(session, url, f"m-{unique}", headers={"X-Lanes-Model-Version": "v9"})
        assert status == 404, body
        error = json.loads(body)["error"]
        assert error["type"] == "version_not_found"
        assert "v1" in error["message"]


async def half_headers(url: str, count: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """`count` connections that each send half a request head and then nothing."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    flood = []
    for _ in range(count):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        flood.append((reader, writer))
    return flood


async def test_a_slow_header_flood_is_timed_out(servers: ServerUrls, unique: str) -> None:
    async with routed(servers, unique, header_timeout_s=1.0) as (session, url, runner):
        flood = await half_headers(url, 300)
        # Every one of them is closed by the router (a read that returned), none answered.
        answers = await asyncio.gather(*(reader.read() for reader, _ in flood))
        assert set(answers) == {b""}
        assert runner.guard is not None
        assert runner.guard.stats.closed_slow_header >= len(flood)
        for _, writer in flood:
            writer.close()
        assert (await chat(session, url, f"m-{unique}"))[0] == 200


async def test_connections_past_the_cap_get_503_at_once(servers: ServerUrls, unique: str) -> None:
    cap = 16
    async with routed(servers, unique, header_timeout_s=120.0, max_connections=cap) as (_session, url, runner):
        assert runner.guard is not None
        stats = runner.guard.stats
        flood = await half_headers(url, cap + 10)

        async def accepted() -> bool:
            return stats.open + stats.refused_full >= len(flood)

        await eventually(accepted, what="the router to accept or refuse every connection")
        assert stats.open <= cap
        assert stats.refused_full >= 10
        # A new client while full gets the answer at once, not a hang; once the flood goes, it is served.
        fresh = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=ANSWER_BOUND_S))
        async with fresh:
            status, headers, _ = await chat(fresh, url, f"m-{unique}")
            assert (status, headers["Retry-After"]) == (503, "1")
            for _, writer in flood:
                writer.close()

            async def served() -> bool:
                return (await chat(fresh, url, f"m-{unique}"))[0] == 200

            await eventually(served, what="a request to be served once the flood is gone")


async def test_tenants_need_their_key_are_limited_and_named_in_provenance(
    servers: ServerUrls, unique: str, tmp_path: Path
) -> None:
    tenants = tmp_path / "tenants.json"
    tenants.write_text(
        json.dumps(
            {
                "admin_key_sha256": key_hash("admin-key"),
                "tenants": {
                    f"team-{unique}": {"key_sha256": key_hash("team-key"), "rate_per_s": 0.01, "burst": 3},
                },
            }
        )
    )
    model = f"m-{unique}"
    async with (
        toys((model, "v1")) as (toy,),
        aiohttp.ClientSession() as session,
        lanes_client(servers) as lanes,
        router_in_process(servers, tenants_file=str(tenants)) as (_runner, url),
    ):
        await announce_replica(lanes, f"r-{unique}", serving(model, "v1"), toy.endpoint)
        admin = {"Authorization": "Bearer admin-key"}

        async def routable() -> bool:
            async with session.get(f"{url}/readyz", headers=admin) as response:
                return response.status == 200 and (await response.json())["routable"] >= 1

        await eventually(routable, what="the replica to be routable")
        assert (await readiness(session, url))[0] == 401  # no admin key
        async with session.get(f"{url}/v1/models") as response:
            assert response.status == 401  # what is served is told only to a tenant or the admin
        async with session.get(f"{url}/v1/models", headers={"Authorization": "Bearer team-key"}) as response:
            assert model in {m["id"] for m in (await response.json())["data"]}
        assert (await chat(session, url, model))[0] == 401
        assert (await chat(session, url, model, headers={"Authorization": "Bearer guess"}))[0] == 401
        team = {"Authorization": "Bearer team-key"}
        statuses = [(await chat(session, url, model, headers=team))[:2] for _ in range(4)]
        assert [status for status, _ in statuses] == [200, 200, 200, 429]
        assert int(statuses[-1][1]["Retry-After"]) >= 1
        served = await wait_served(lanes, model, 3)
    assert {event.data.tenant for event in served} == {f"team-{unique}"}
