"""No open doors on loopback (issue 34, item 9): a service's `/metrics` binds loopback unless told otherwise.

Each service process serves Prometheus `/metrics` on LANES_METRICS_PORT. It bound 0.0.0.0, with no setting
to change it: anyone who could reach the machine read every consumer's counters. It now binds
LANES_METRICS_HOST, 127.0.0.1 by default; the compose file sets 0.0.0.0, where a scraper outside the
container must reach it. Checked on a real `lanes serve audit` process, by the socket the kernel lists.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from support.cli import lanes_process
from support.ports import free_port
from support.waiting import eventually

from lanes_runtime.settings import ServerUrls
from lanes_sandbox.embedded import EmbeddedNats

pytestmark = [pytest.mark.asyncio, pytest.mark.real_servers]
_LISTEN = "0A"
"""The state column of a listening socket in /proc/net/tcp."""


def _listening_on(port: int) -> set[str]:
    """The IPv4 addresses a socket listens on at `port` (/proc/net/tcp: little-endian hex address:port)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, _, hex_port = local.partition(":")
        if state == _LISTEN and int(hex_port, 16) == port:
            found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


@pytest.mark.parametrize(
    ("host", "bound"),
    [(None, "127.0.0.1"), ("0.0.0.0", "0.0.0.0")],  # noqa: S104 - the container's explicit choice
    ids=["loopback-by-default", "all-interfaces-when-told"],
)
async def test_metrics_bind_loopback_unless_told_otherwise(
    secured_nats: EmbeddedNats, urls: ServerUrls, monkeypatch: pytest.MonkeyPatch, *, host: str | None, bound: str
) -> None:
    monkeypatch.delenv("LANES_METRICS_HOST", raising=False)  # the process inherits this environment
    port = free_port()
    env = {
        "NATS_URL": secured_nats.url_for("audit"),
        "DATABASE_URL": urls.database_url,
        "REDIS_URL": urls.redis_url,
        "LANES_METRICS_PORT": str(port),
    }
    if host is not None:
        env["LANES_METRICS_HOST"] = host
    async with lanes_process("serve", "audit", env=env):

        async def listening() -> bool:
            return bool(_listening_on(port))

        await eventually(listening, timeout_s=60, what=f"/metrics listening on port {port}")
        assert _listening_on(port) == {bound}
