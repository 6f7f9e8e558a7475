"""Running the `lanes` command against a given set of servers, and a stack of services, for the CLI tests.

`run_lanes` runs a command in this process with Typer's runner: no interpreter start, the same exit codes,
stdout and stderr. Tests of what only a process shows (signals, embedded servers cleaned up on exit,
`lanes up`, `lanes serve`, `lanes demo`) start `LANES` as a subprocess instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from typer.testing import CliRunner

from lanes_agent.launcher import STOP_GRACE_S, LocalLauncher
from lanes_cli.bootstrap import prepare_services
from lanes_cli.cli import app
from lanes_cli.demo import DEMO_NODES, register_nodes, wait_for_nodes
from lanes_contract.client import LanesClient
from lanes_runtime.service import Connections, connected, run_consumers
from lanes_runtime.settings import ServerUrls

LANES = str(Path(sys.executable).parent / "lanes")
"""The installed `lanes` command, for the tests that need it as a process of its own."""


@dataclass(frozen=True)
class Ran:
    """What a `lanes` command did: its exit code and what it printed."""

    returncode: int
    stdout: str
    stderr: str


def run_lanes(urls: ServerUrls | None, *args: str, env: Mapping[str, str | None] | None = None) -> Ran:
    """`lanes ARGS` in this process, with the servers' URLs, JSON logs and a wide terminal (no wrapped lines).

    `env` adds or (with None) removes variables, e.g. `{"DATABASE_URL": None}` for a command that must
    work from NATS alone.
    """
    given: dict[str, str | None] = {"LANES_LOG_FORMAT": "json", "COLUMNS": "400"}
    if urls is not None:
        given |= {"NATS_URL": urls.nats_url, "DATABASE_URL": urls.database_url, "REDIS_URL": urls.redis_url}

    def invoke() -> Ran:
        result = CliRunner().invoke(app, list(args), env=given | dict(env or {}), catch_exceptions=False)
        return Ran(result.exit_code, result.stdout, result.stderr)

    # A worker thread of its own: the command runs its own event loop, which a thread that already runs
    # one (an async test) could not start.
    with ThreadPoolExecutor(max_workers=1) as worker:
        return worker.submit(invoke).result()


async def run_lanes_async(urls: ServerUrls | None, *args: str, env: Mapping[str, str | None] | None = None) -> Ran:
    """`run_lanes` without blocking the event loop (services may be running in it)."""
    return await asyncio.to_thread(run_lanes, urls, *args, env=env)


@contextlib.asynccontextmanager
async def lanes_process(*args: str, env: Mapping[str, str]) -> AsyncIterator[asyncio.subprocess.Process]:
    """`lanes ARGS` as a process of its own (JSON logs, stdout discarded); SIGTERMed on leaving unless gone."""
    proc = await asyncio.create_subprocess_exec(
        LANES, *args, env=os.environ | {"LANES_LOG_FORMAT": "json"} | dict(env), stdout=asyncio.subprocess.DEVNULL
    )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()


@contextlib.asynccontextmanager
async def local_stack(
    urls: ServerUrls,
    services: Iterable[str],
    *,
    nodes: bool = True,
    agent: bool = True,
    stop_grace_s: float = STOP_GRACE_S,
    kernel_log: Path | None = None,
) -> AsyncIterator[Connections]:
    """Services as `lanes up` runs them; with `nodes`, the demo's nodes registered and (with `agent`) a local
    launcher for them in this process (without it, the test runs `lanes agent` itself)."""
    async with connected(urls, name="cli-tests") as conns:
        stop = asyncio.Event()
        consumers = await prepare_services(conns, services)
        tasks = [asyncio.create_task(run_consumers(consumers, stop))]
        if nodes and agent:
            tasks.append(
                asyncio.create_task(
                    LocalLauncher(
                        conns.nc, frozenset(DEMO_NODES), stop_grace_s=stop_grace_s, kernel_log=kernel_log
                    ).run(stop)
                )
            )
        try:
            if nodes:
                await register_nodes(LanesClient(conns.nc, "tests"), DEMO_NODES)
                await wait_for_nodes(conns, len(DEMO_NODES), 30)
            yield conns
        finally:
            stop.set()
            await asyncio.gather(*tasks)
