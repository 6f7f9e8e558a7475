"""Connecting to servers Lanes supports, refusing those it does not, and provisioning streams."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from nats.js.api import RetentionPolicy
from support.servers import server_announcing

from lanes_contract.client import MIN_NATS_VERSION, connect_nats
from lanes_contract.errors import ServerUnavailableError, StreamConflictError, UnsupportedServerError
from lanes_contract.streams import StreamSpec, provision_streams
from lanes_runtime.settings import ServerUrls

pytestmark = pytest.mark.real_servers


async def test_a_nats_server_below_the_floor_is_refused_with_what_to_run() -> None:
    async with server_announcing("2.9.10") as url:
        with pytest.raises(UnsupportedServerError) as refused:
            await connect_nats(url, name="tests")
    message = str(refused.value)
    assert "2.9.10" in message
    assert ">= 2.11.0" in message
    assert "Unset NATS_URL" in message


def _machine_nats_port() -> int | None:
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return 4222 if probe.connect_ex(("127.0.0.1", 4222)) == 0 else None


@pytest.mark.skipif(_machine_nats_port() is None, reason="no NATS server listens on 127.0.0.1:4222 here")
async def test_the_machines_own_old_nats_is_refused() -> None:
    # On the CI machine this is Debian's nats-server 2.9.10; a newer one would be accepted.
    refusal: UnsupportedServerError | None = None
    try:
        nc = await connect_nats("nats://127.0.0.1:4222", name="tests")
    except UnsupportedServerError as exc:
        refusal = exc
    else:
        version = nc.connected_server_version
        await nc.close()
        assert (version.major, version.minor, version.patch) >= MIN_NATS_VERSION
    assert refusal is None or "too old" in str(refusal) or "JetStream" in str(refusal)


async def test_a_nats_server_without_jetstream_is_refused(tmp_path: Path) -> None:
    binary = Path(sys.executable).parent / "nats-server"
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    server = await asyncio.create_subprocess_exec(binary, "-a", "127.0.0.1", "-p", str(port), stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            await asyncio.sleep(0.05)
        with pytest.raises(UnsupportedServerError, match="JetStream is not enabled"):
            await connect_nats(f"nats://127.0.0.1:{port}", name="tests")
    finally:
        server.terminate()
        await asyncio.wait_for(server.wait(), timeout=10)


async def test_an_unreachable_nats_is_a_clear_error() -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with pytest.raises(ServerUnavailableError, match="cannot reach NATS"):
        await connect_nats(f"nats://127.0.0.1:{port}", name="tests", connect_timeout_s=1)


async def test_provisioning_strengthens_but_never_weakens_a_stream(servers: ServerUrls, unique: str) -> None:
    nc = await connect_nats(servers.nats_url, name="tests")
    js = nc.jetstream()
    spec = StreamSpec(
        name=f"T_{unique}", subjects=(f"t{unique}.a.>",), description="test", max_age_s=60.0, duplicate_window_s=30.0
    )
    try:
        assert await provision_streams(js, (spec,)) == {spec.name: "created"}
        assert await provision_streams(js, (spec,)) == {spec.name: "unchanged"}
        longer = replace(spec, max_age_s=3600.0, subjects=(*spec.subjects, f"t{unique}.b.>"), deny_delete=True)
        assert await provision_streams(js, (longer,)) == {spec.name: "updated"}
        config = (await js.stream_info(spec.name)).config
        assert config.max_age == 3600.0
        assert set(config.subjects or []) == {f"t{unique}.a.>", f"t{unique}.b.>"}
        assert config.deny_delete
        # Asking for less keeps what is there: nothing is shortened or removed.
        assert await provision_streams(js, (spec,)) == {spec.name: "unchanged"}
        assert (await js.stream_info(spec.name)).config.max_age == 3600.0
        with pytest.raises(StreamConflictError, match="retention"):
            await provision_streams(js, (replace(spec, retention=RetentionPolicy.WORK_QUEUE),))
    finally:
        await js.delete_stream(spec.name)
        await nc.close()
