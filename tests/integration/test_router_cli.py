"""`lanes requests` and `lanes route drain | ready` against real servers, a real router and a toy replica."""

from __future__ import annotations

import json

import aiohttp
import pytest
from support.cli import run_lanes_async
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

from lanes_runtime.settings import ServerUrls

pytestmark = pytest.mark.real_servers


@pytest.mark.slow
async def test_requests_lists_provenance_and_route_drains_and_readies_a_replica(urls: ServerUrls, unique: str) -> None:
    model = f"m-{unique}"
    replica = f"r-{unique}"
    async with (
        toys((model, "v1")) as (toy,),
        aiohttp.ClientSession() as session,
        lanes_client(urls) as lanes,
        router_in_process(urls) as (_runner, url),
    ):
        await announce_replica(lanes, replica, serving(model, "v1"), toy.endpoint)
        await wait_routable(session, url, model, 1)
        for i in range(2):
            status, _, _ = await chat(session, url, model, stream=i == 1, headers={"X-Request-Id": f"cli-{unique}-{i}"})
            assert status == 200
        await wait_served(lanes, model, 2)

        listed = await run_lanes_async(urls, "requests", "--model", model, "--json")
        assert listed.returncode == 0, listed.stderr
        lines = [json.loads(line) for line in listed.stdout.splitlines()]
        assert [line["data"]["request_id"] for line in lines] == [f"cli-{unique}-0", f"cli-{unique}-1"]
        assert all(line["type"] == "io.lanes.req.served.v1" and line["jobid"] == replica for line in lines)
        table = await run_lanes_async(urls, "requests", "--model", model)
        assert table.returncode == 0, table.stderr
        assert f"cli-{unique}-1" in table.stdout
        assert "ok" in table.stdout

        drained = await run_lanes_async(urls, "route", "drain", replica, "--reason", "rollback of v1")
        assert drained.returncode == 0, drained.stderr
        assert json.loads(drained.stdout)["state"] == "draining"

        async def refused() -> bool:
            status, _, _ = await chat(session, url, model)
            return status == 503

        await eventually(refused, what="the drained replica to leave rotation")
        readied = await run_lanes_async(urls, "route", "ready", replica)
        assert readied.returncode == 0, readied.stderr
        await wait_routable(session, url, model, 1)

    unknown = await run_lanes_async(urls, "route", "drain", f"nope-{unique}")
    assert unknown.returncode == 3
    assert "unknown replica" in unknown.stderr
    bad = await run_lanes_async(urls, "requests", "--model", "a.b")
    assert bad.returncode == 2
