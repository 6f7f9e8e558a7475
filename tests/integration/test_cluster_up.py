"""`lanes up --cluster 3 --replicas 2`: three routed nats-servers with the timeline at R3 and every write fsynced,
PostgreSQL and Redis, two processes of every service; a submitted job runs through to released, and Ctrl-C
leaves nothing behind."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.cli import LANES
from support.processes import interruptible
from support.waiting import eventually

from lanes_cli.bootstrap import SERVICES
from lanes_contract.client import connect_nats
from lanes_contract.streams import ALL_STREAMS

pytestmark = [pytest.mark.real_servers, pytest.mark.slow]


@pytest.fixture
def private_tmp() -> Iterator[Path]:
    """A TMPDIR of the run's own: what `lanes up` leaves behind is looked for there only."""
    root = Path(tempfile.mkdtemp(prefix="lanes-cluster-test-"))
    root.chmod(0o755)  # the unprivileged PostgreSQL user must be able to pass through
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"NATS_URL", "DATABASE_URL", "REDIS_URL"}}
    return env | {"LANES_LOG_FORMAT": "json"} | extra


def _children(pid: int) -> list[str]:
    """The command lines of `pid`'s child processes."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            found.append(cmdline)
    return found


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _nats_configs(root: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in root.glob("lanes-*/nats.conf")]


def _lanes(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([LANES, *args], env=env, capture_output=True, text=True, timeout=120, check=False)


def _up(private_tmp: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [LANES, "up", "--cluster", "3", "--replicas", "2"],
        env=_env(TMPDIR=str(private_tmp), LANES_CONSOLE_PORT="0"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=interruptible,  # noqa: PLW1509 - only sets a signal disposition before exec
    )


async def test_up_with_a_cluster_and_replicas_runs_a_job_through(tmp_path: Path, private_tmp: Path) -> None:
    up = _up(private_tmp)
    try:
        assert up.stdout is not None
        exports: dict[str, str] = {}
        for line in up.stdout:
            if line.startswith("export "):
                name, _, value = line.removeprefix("export ").strip().partition("=")
                exports[name] = value
            if "Ctrl-C to stop" in line:
                break
        assert exports, "lanes up exited before printing its URLs"
        assert len(exports["NATS_URL"].split(",")) == 3  # a client given every server fails over among them

        # Three servers, the timeline at R3 on all three, each fsyncing every write before acknowledging it.
        nc = await connect_nats(exports["NATS_URL"], name="cluster-up-check")
        try:
            js = nc.jetstream()
            for stream in ALL_STREAMS:
                info = await js.stream_info(stream.name)
                assert info.config.num_replicas == 3, stream.name
                assert info.cluster is not None
                assert len(info.cluster.replicas or []) == 2, stream.name  # the leader and two followers
        finally:
            await nc.close()
        configs = await asyncio.to_thread(_nats_configs, private_tmp)
        assert len(configs) == 3
        assert all(c["jetstream"]["sync_interval"] == "always" for c in configs)

        # Two processes of every service, children of `lanes up`.
        wanted = sorted(name for name in SERVICES for _ in range(2))

        async def replicas_running() -> bool:
            serving = [c.split(" serve ", 1)[1].strip() for c in _children(up.pid) if " serve " in c]
            return sorted(serving) == wanted

        await eventually(replicas_running, what=f"processes {wanted}")

        env = _env(**exports)
        spec = tmp_path / "job.yaml"
        spec.write_text("job_id: cluster-job-1\nname: cluster-job\nworkers: 2\ngpus_per_worker: 2\n")
        submitted = await asyncio.to_thread(_lanes, "submit", str(spec), env=env)
        assert submitted.returncode == 0, submitted.stderr

        async def released() -> bool:
            shown = await asyncio.to_thread(_lanes, "job", "cluster-job-1", "--json", env=env)
            return shown.returncode == 0 and json.loads(shown.stdout)["state"] == "released"

        await eventually(released, timeout_s=120, what="the job released by the replicated services")
        timeline = await asyncio.to_thread(_lanes, "timeline", "cluster-job-1", "--json", env=env)
        events = json.loads(timeline.stdout)["timeline"]
        # Two replicas of each service share its durables: every fact is there once, none twice.
        states = [e["data"]["to_state"] for e in events if e["type"] == "io.lanes.job.state_changed.v1"]
        assert states == ["queued", "admitted", "starting", "running", "succeeded", "released"]
        assert sum(e["type"] == "io.lanes.job.placed.v1" for e in events) == 1
    finally:
        up.send_signal(signal.SIGINT)
        await asyncio.to_thread(up.wait, 90)
    assert up.returncode == 0

    async def cleaned() -> bool:
        return not await asyncio.to_thread(_leftovers, private_tmp)

    await eventually(cleaned, what="the servers' and replicas' directories removed")
