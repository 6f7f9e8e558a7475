"""Limits at the server, and no open doors on loopback (issue 34, items 7 and 9), on a real embedded NATS.

Before: an agent's raw 1 MB message was stored in LANES_JOBS (`max_msg_size` -1, kept a year), and the
embedded server's monitoring port listed users and subscriptions to anyone on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
from nats.js.errors import APIError

from lanes_contract.client import connect_nats
from lanes_contract.streams import (
    JOBS,
    MAX_EVENT_MESSAGE_BYTES,
    MAX_PAYLOAD_BYTES,
    provision_streams,
)
from lanes_sandbox.embedded import EmbeddedNats

pytestmark = pytest.mark.real_servers


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection (a reset ends it too: what came is kept)."""
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := await asyncio.wait_for(reader.read(4096), timeout=30):
            received += chunk
    return received


async def stored_on(nats: EmbeddedNats, subject: str) -> int:
    admin = await connect_nats(nats.url, name="inspector")
    try:
        info = await admin.jetstream().stream_info(JOBS.name, subjects_filter=subject)
        return sum((info.state.subjects or {}).values())
    finally:
        await admin.close()


@pytest.mark.asyncio
async def test_a_message_bigger_than_any_event_is_refused_by_its_stream(
    secured_nats: EmbeddedNats, unique: str
) -> None:
    """Under the server's max_payload but over the stream's limit: JetStream refuses to store it."""
    subject = f"lanes.job.big-{unique}.heartbeat"
    nc = await connect_nats(secured_nats.url_for("agent-node-1"), name="agent-node-1")
    try:
        with pytest.raises(APIError, match="message size exceeds maximum allowed"):
            await nc.jetstream().publish(subject, b"x" * MAX_EVENT_MESSAGE_BYTES, stream=JOBS.name)
        ok = await nc.jetstream().publish(subject, b"x" * 1024, stream=JOBS.name)
    finally:
        await nc.close()
    assert await stored_on(secured_nats, subject) == 1
    assert ok.seq > 0


@pytest.mark.asyncio
async def test_a_raw_one_megabyte_publish_is_refused_by_the_server_itself(secured_nats: EmbeddedNats) -> None:
    """Sent on a bare socket, as an attacker's client would (nats-py would refuse it before sending): the server
    announces its max_payload, and a bigger PUB is a protocol violation that closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", secured_nats.port)
    try:
        info = json.loads((await reader.readline()).removeprefix(b"INFO "))
        assert info["max_payload"] == MAX_PAYLOAD_BYTES
        password = secured_nats.passwords["agent-node-1"]
        connect = {"user": "agent-node-1", "pass": password, "verbose": False, "pedantic": False, "headers": True}
        payload = b"x" * (1 << 20)
        writer.write(f"CONNECT {json.dumps(connect)}\r\nPING\r\n".encode())
        assert (await reader.readline()).startswith(b"PONG")
        writer.write(f"PUB lanes.job.raw.heartbeat {len(payload)}\r\n".encode() + payload + b"\r\n")
        # The server answers the PUB line at once and closes the connection: the rest of the megabyte may then
        # meet a reset socket, and the answer may or may not have been read by then. Either way it is refused.
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            await writer.drain()
        answer = await _read_all(reader)
    finally:
        writer.close()
    # Read to the end: the server closed the connection, saying why unless the reset swallowed its answer.
    assert b"maximum payload" in answer.lower() or not answer
    assert await stored_on(secured_nats, "lanes.job.raw.heartbeat") == 0


@pytest.mark.asyncio
async def test_provisioning_lowers_the_message_size_of_a_stream_made_before_the_limit() -> None:
    with EmbeddedNats(provision=False) as nats:
        admin = await connect_nats(nats.url, name="admin")
        try:
            js = admin.jetstream()
            await js.add_stream(replace(JOBS.config(), max_msg_size=-1))
            outcome = await provision_streams(js, (JOBS,))
            assert outcome == {JOBS.name: "updated"}
            assert (await js.stream_info(JOBS.name)).config.max_msg_size == MAX_EVENT_MESSAGE_BYTES
        finally:
            await admin.close()


def listening_ports(pid: int) -> set[int]:
    """The TCP ports a process listens on (its sockets' inodes, looked up in /proc/net/tcp and tcp6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = str(fd.readlink())
        if target.startswith("socket:["):
            inodes.add(target.removeprefix("socket:[").removesuffix("]"))
    ports = set()
    listen = "0A"
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        for line in table.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == listen and fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_the_embedded_server_opens_no_monitoring_port_unless_asked() -> None:
    with EmbeddedNats(provision=False) as nats:
        assert nats.pid is not None
        assert listening_ports(nats.pid) == {nats.port}
    with EmbeddedNats(provision=False, monitor=True) as monitored:
        assert monitored.pid is not None
        monitor_port = int(monitored.monitor_url.rsplit(":", 1)[1])
        assert listening_ports(monitored.pid) == {monitored.port, monitor_port}
