"""Running the `lanes` command against a given set of servers, and a stack of services, for the CLI tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

from lanes_agent.launcher import LocalLauncher
from lanes_cli.bootstrap import prepare_services
from lanes_cli.demo import DEMO_NODES, register_nodes, wait_for_nodes
from lanes_contract.client import LanesClient
from lanes_runtime.service import Connections, connected, run_consumers
from lanes_runtime.settings import ServerUrls

LANES = str(Path(sys.executable).parent / "lanes")


def run_lanes(urls: ServerUrls, *args: str) -> subprocess.CompletedProcess[str]:
    """`lanes ARGS` with the three server URLs, JSON logs and a wide terminal (no wrapped lines)."""
    env = os.environ | {
        "NATS_URL": urls.nats_url,
        "DATABASE_URL": urls.database_url,
        "REDIS_URL": urls.redis_url,
        "LANES_LOG_FORMAT": "json",
        "COLUMNS": "400",
    }
    return subprocess.run([LANES, *args], env=env, capture_output=True, text=True, timeout=120, check=False)


async def run_lanes_async(urls: ServerUrls, *args: str) -> subprocess.CompletedProcess[str]:
    """`run_lanes` without blocking the event loop (services may be running in it)."""
    return await asyncio.to_thread(run_lanes, urls, *args)


@contextlib.asynccontextmanager
async def local_stack(urls: ServerUrls, services: Iterable[str], *, nodes: bool = True) -> AsyncIterator[Connections]:
    """Services as `lanes up` runs them; with `nodes`, a local launcher on the demo's nodes, registered."""
    async with connected(urls, name="cli-tests") as conns:
        stop = asyncio.Event()
        consumers = await prepare_services(conns, services)
        tasks = [asyncio.create_task(run_consumers(consumers, stop))]
        if nodes:
            tasks.append(asyncio.create_task(LocalLauncher(conns.nc, frozenset(DEMO_NODES)).run(stop)))
        try:
            if nodes:
                await register_nodes(LanesClient(conns.nc, "tests"), DEMO_NODES)
                await wait_for_nodes(conns, len(DEMO_NODES), 30)
            yield conns
        finally:
            stop.set()
            await asyncio.gather(*tasks)
