"""A bus outage in a client's log: one line when the connection drops, one when it is back, none per retry.

nats-py retries a lost connection every half second and reports each failed try to the error callback; a
service that logged each one wrote two warnings a second for as long as NATS was down.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from nats.aio.client import Client as NatsClient
from support.logs import json_logs
from support.restartable_nats import RestartableNats
from support.waiting import eventually

from lanes_contract.client import connect_nats

pytestmark = pytest.mark.real_servers

LOST = "nats connection lost; reconnecting until it answers"
BACK = "nats connection back"
RETRY_FAILED = "nats connection error"
OUTAGE_S = 3.0
"""How long the server stays stopped: several of the client's half-second reconnect tries."""


async def test_a_stopped_bus_is_logged_once_when_lost_and_once_when_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nats = RestartableNats(tmp_path / "nats")
    nats.start()
    try:
        with json_logs(capsys) as logs:
            nc = await connect_nats(nats.url, name="tests-connection-log")
            try:
                nats.stop()
                await eventually(lambda: _said(logs.lines(), LOST), what="the lost connection to be logged")
                await asyncio.sleep(OUTAGE_S)  # the outage lasts: not an assertion on time
                nats.start()
                await eventually(lambda: _is_connected(nc), timeout_s=30, what="the client to reconnect")
            finally:
                await nc.close()
            lines = [line for line in logs.lines() if str(line.get("event", "")).startswith("nats connection")]
    finally:
        nats.stop()
    assert [line["event"] for line in lines if line["event"] != RETRY_FAILED] == [LOST, BACK], lines
    assert [line["level"] for line in lines if line["event"] == LOST] == ["warning"]
    # At most the drop itself may be reported as an error before the outage is known; never each retry.
    assert sum(line["event"] == RETRY_FAILED for line in lines) <= 1, lines


async def _said(lines: list[dict[str, object]], event: str) -> bool:
    return any(line.get("event") == event for line in lines)


async def _is_connected(nc: NatsClient) -> bool:
    return bool(nc.is_connected)
