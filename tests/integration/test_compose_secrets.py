"""The compose stack's secrets: the generated TLS and per-identity users work on a real nats-server.

`deploy/nats/nats.conf` with the generated files passes `nats-server -t`; a node started with the same TLS
block and `auth.conf` refuses a plain-text client, accepts each identity over TLS (trusting the generated
CA through SSL_CERT_FILE, as the containers do) and enforces the roles.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.ports import free_port

from lanes_sandbox.nats_server import _find_nats

ROOT = Path(__file__).resolve().parents[2]


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("lanes_deploy_secrets", ROOT / "deploy" / "secrets" / "generate.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pytestmark = pytest.mark.real_servers


def _env_of(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line)


def _plain_text_is_refused(port: int) -> bool:
    """The server demands TLS, and a client speaking plain text after its INFO gets no PONG."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock, sock.makefile("rb") as reader:
        info = json.loads(reader.readline()[5:])
        sock.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n')
        try:
            answer = reader.readline()
        except OSError:
            answer = b""
    return bool(info.get("tls_required")) and not answer.startswith(b"PONG")


_CLIENT = """
import asyncio, os, sys
from lanes_contract.client import LanesClient, connect_nats
from lanes_contract.errors import PermissionDeniedError
from lanes_contract.events import JobPlaced, JobPlacedData, RankAssignment
from lanes_contract.streams import provision_streams

def placed(job):
    data = JobPlacedData(assignments=(RankAssignment(rank=0, node="node-1", gpus=(0,)),))
    return JobPlaced(source="lanes/scheduler", jobid=job, attempt=1, data=data)

async def main(admin, scheduler, cli):
    nc = await connect_nats(admin, name="provision")
    await provision_streams(nc.jetstream())
    await nc.close()
    async with await LanesClient.connect(scheduler, source="lanes/scheduler") as client:
        assert await client.publish(placed("ok")) > 0
    async with await LanesClient.connect(cli, source="lanes/cli") as client:
        try:
            await client.publish(placed("forged"))
        except PermissionDeniedError:
            print("cli refused")

asyncio.run(main(*sys.argv[1:]))
"""


def test_the_generated_tls_and_users_work_on_a_real_server(tmp_path: Path) -> None:
    secrets_dir = tmp_path / "secrets"
    _generator().generate(secrets_dir, ("node-1",), hosts=("localhost",))
    binary = str(_find_nats().path)

    deploy_conf = (ROOT / "deploy" / "nats" / "nats.conf").read_text()
    rendered = secrets_dir / "nats.conf"
    rendered.write_text(deploy_conf.replace("/run/lanes-secrets", str(secrets_dir)).replace('"/data"', f'"{tmp_path}"'))
    check = subprocess.run(
        [binary, "-t", "-c", str(rendered)], env={"NATS_SERVER_NAME": "n1"}, capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stderr

    port = free_port()
    single = secrets_dir / "single.conf"
    single.write_text(
        f'port: {port}\nlisten: "127.0.0.1:{port}"\njetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
        f'tls {{ cert_file: "{secrets_dir / "nats-cert.pem"}", key_file: "{secrets_dir / "nats-key.pem"}" }}\n'
        'include "auth.conf"\n'
    )
    server = subprocess.Popen([binary, "-c", str(single)], stderr=subprocess.PIPE, text=True)
    try:
        assert server.stderr is not None
        for line in server.stderr:
            if "Server is ready" in line:
                break
        urls = {name: _env_of(secrets_dir / f"{name}.env")["NATS_URL"] for name in ("admin", "scheduler", "cli")}
        urls = {name: url.replace(":4222", f":{port}") for name, url in urls.items()}
        env = os.environ | {"SSL_CERT_FILE": str(secrets_dir / "ca.pem"), "LANES_LOG_LEVEL": "error"}
        env.pop("LANES_SIGNING_KEY_FILE", None)
        client = subprocess.run(
            [sys.executable, "-c", _CLIENT, urls["admin"], urls["scheduler"], urls["cli"]],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert client.returncode == 0, client.stderr[-3000:]
        assert "cli refused" in client.stdout
        assert _plain_text_is_refused(port)
    finally:
        server.terminate()
        server.wait(timeout=20)
