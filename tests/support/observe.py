"""Helpers for the observe-mode tests: a stack of services, a job's timeline events and its state."""

from __future__ import annotations

import json
import socket
from typing import Any

from lanes_cli.timeline import job_timeline
from lanes_contract.events import Event
from lanes_runtime.service import Connections
from lanes_runtime.settings import ServerUrls
from support.cli import run_lanes_async

OBSERVE_SERVICES = ["scheduler", "lifecycle", "telemetry", "recovery"]
"""What treats an observed job like any other: the scheduler (which must leave it alone) and the rest."""


def closed_nats_url() -> str:
    """A NATS URL nothing listens on: a server that is down."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"nats://127.0.0.1:{port}"


async def timeline_events(conns: Connections, job_id: str) -> list[Event]:
    """The job's events, in stream order."""
    return [entry.event for entry in await job_timeline(conns.nc.jetstream(), job_id) if entry.event is not None]


async def job_view(urls: ServerUrls, job_id: str) -> dict[str, Any] | None:
    """`lanes job --json`: the lifecycle's projection of the job (None while it has none)."""
    ran = await run_lanes_async(urls, "job", job_id, "--json")
    return json.loads(ran.stdout) if ran.returncode == 0 else None


async def in_state(urls: ServerUrls, job_id: str, state: str) -> bool:
    """Whether the lifecycle's projection shows the job in `state`."""
    view = await job_view(urls, job_id)
    return view is not None and view["state"] == state


async def poc_verdicts(urls: ServerUrls, job_id: str) -> dict[str, str]:
    """`lanes poc --job`: each capability's verdict for this job."""
    ran = await run_lanes_async(urls, "poc", "--job", job_id, "--json")
    assert ran.returncode == 0, ran.stderr
    return {c["capability"]: c["verdict"] for c in json.loads(ran.stdout)["capabilities"]}
