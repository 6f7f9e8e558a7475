"""The `lanes` command as a user runs it: real processes, real servers, exit codes and output."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
from support.cli import LANES
from support.processes import interruptible
from support.servers import server_announcing

from lanes_agent.faults import kernel_faults_unavailable
from lanes_agent.netns import NodeNetworks
from lanes_cli.demo import local_nodes
from lanes_runtime.settings import ServerUrls

pytestmark = pytest.mark.real_servers
SERVER_NAMES = ("nats-server", "postgres", "redis-server")


def _env(**urls: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"NATS_URL", "DATABASE_URL", "REDIS_URL"}}
    return env | urls | {"LANES_LOG_FORMAT": "json"}


def _lanes(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([LANES, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture
def private_tmp() -> Iterator[Path]:
    """A TMPDIR of the run's own, so servers and dirs of other processes on the machine are never counted."""
    root = Path(tempfile.mkdtemp(prefix="lanes-cli-test-"))
    root.chmod(0o755)  # the unprivileged PostgreSQL user must be able to pass through
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _servers_using(root: Path) -> set[int]:
    pids = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                name = (proc / "comm").read_text().strip()
                cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if name in SERVER_NAMES and str(root) in cmdline:
                pids.add(int(proc.name))
    return pids


def _gone(root: Path, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        dirs, pids = sorted(p.name for p in root.iterdir()), _servers_using(root)
        if not dirs and not pids:
            return
        assert time.monotonic() < deadline, f"left behind: dirs {dirs}, server pids {pids}"
        time.sleep(0.1)


@pytest.mark.slow
def test_demo_json_on_embedded_servers_runs_the_job_to_the_end(private_tmp: Path) -> None:
    result = _lanes("demo", "--json", env=_env(TMPDIR=str(private_tmp)))
    assert result.returncode == 0, result.stderr[-3000:]
    job = json.loads(result.stdout)["jobs"][0]  # the training job that succeeds
    assert job["state"] == "released"
    (attempt,) = job["attempts"]
    assert attempt["state"] == "released"
    assert len({a["node"] for a in attempt["placement"]}) == 2  # 2 workers x 4 GPUs: two whole nodes
    assert {a["node"] for a in attempt["placement"]} <= {"node-1", "node-2", "node-3", "node-4"}
    timeline = job["timeline"]
    assert [e["seq"] for e in timeline] == sorted(e["seq"] for e in timeline)
    for entry in timeline:
        assert set(entry) == {
            "seq",
            "id",
            "time",
            "type",
            "lane",
            "job_id",
            "attempt",
            "node",
            "rank",
            "source",
            "signer",
            "signature",
            "data",
        }
        assert entry["signature"] == "verified"  # the demo checks each event against its server's keyring
        assert entry["job_id"] == job["job_id"]
        assert entry["attempt"] == 1
    states = [e["data"]["to_state"] for e in timeline if e["type"] == "io.lanes.job.state_changed.v1"]
    assert states == ["queued", "admitted", "starting", "running", "succeeded", "released"]
    exits = [e for e in timeline if e["type"] == "io.lanes.job.rank_exited.v1"]
    placed = {a["rank"]: a["node"] for a in attempt["placement"]}
    assert sorted((e["rank"], e["node"], e["data"]["exit_code"]) for e in exits) == [
        (0, placed[0], 0),
        (1, placed[1], 0),
    ]
    assert {e["lane"] for e in exits} == {"host"}
    _gone(private_tmp)


@pytest.mark.slow
def test_demo_prints_the_timeline_grouped_by_lane() -> None:
    result = _lanes("demo", env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    # A demo that tells its stories while a service keeps failing behind them is not a passing demo.
    errors = [line for line in result.stderr.splitlines() if '"level": "error"' in line]
    assert not errors, errors[:3]
    out = result.stdout
    assert out.index("platform lane") < out.index("host lane")
    job_id = out.split()[1]
    event_lines = [line for line in out.splitlines() if line.strip().startswith("#")]
    assert len(event_lines) >= 12
    assert any(f"job={job_id}" in line for line in event_lines)
    assert "finding for demo-oom-" in out
    assert "POC scorecard" in out
    for line in event_lines:
        assert "job=demo-" in line
        assert "attempt=" in line  # a user command names no attempt: "attempt=-"
        assert "node=" in line
        assert "job." in line  # the event type


_NO_REAL_NODES = NodeNetworks.unavailable() or kernel_faults_unavailable()


@pytest.mark.slow
@pytest.mark.skipif(_NO_REAL_NODES is not None, reason=f"--netns --kernel: {_NO_REAL_NODES}")
def test_demo_on_nodes_in_namespaces_with_faults_through_the_kernel_tells_the_same_stories(private_tmp: Path) -> None:
    result = _lanes("demo", "--json", "--netns", "--kernel", env=_env(TMPDIR=str(private_tmp)))
    assert result.returncode == 0, result.stderr[-3000:]  # every story ended as written, every decision agreed
    run = json.loads(result.stdout)
    assert "network namespace" in run["fault_paths"]["links"]
    assert "/dev/kmsg" in run["fault_paths"]["oom_kill"]
    # The OOM-killed rank is named from the kernel's own line, from its memory cgroup.
    error = run["incident"]["summary"]["first_error"]
    assert (error["category"], error["lane"], error["rank"]) == ("oom_kill", "host", 2)
    assert any(line.startswith("Memory cgroup out of memory: Killed process") for line in error["evidence"])
    # The router reached the replicas at their nodes' addresses, across the bridge; the Xid came from kmsg.
    replica_a = next(job for job in run["jobs"] if job["job_id"] == run["inference"]["replicas"][0])
    endpoints = [e["data"]["endpoint"] for e in replica_a["timeline"] if e["type"].endswith(".replica_listening.v1")]
    assert endpoints
    assert all(endpoint.startswith("http://10.77.") for endpoint in endpoints)
    assert run["inference"]["incident"]["summary"]["first_error"]["category"] == "gpu_xid"
    assert run["inference"]["clients"].get("ok", 0) > 0
    bridge = NodeNetworks(list(local_nodes(4, 4))).bridge
    assert bridge in run["fault_paths"]["links"]
    assert not Path(f"/sys/class/net/{bridge}").exists()  # the namespaces and the bridge are gone afterwards


@pytest.mark.slow
async def test_demo_uses_the_servers_the_environment_names(servers: ServerUrls, database_url: str) -> None:
    env = _env(DATABASE_URL=database_url, REDIS_URL=servers.redis_url)
    result = await asyncio.to_thread(_lanes, "demo", "--json", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    job = json.loads(result.stdout)["jobs"][0]  # the training job that succeeds
    conn = await asyncpg.connect(database_url)
    try:
        state = await conn.fetchval("SELECT state FROM lifecycle_jobs WHERE job_id = $1", job["job_id"])
    finally:
        await conn.close()
    assert state == "released"


def _up(private_tmp: Path) -> subprocess.Popen[str]:
    """`lanes up` on embedded servers whose files go under `private_tmp`, its stdout read by the test."""
    return subprocess.Popen(
        [LANES, "up"],
        env=_env(TMPDIR=str(private_tmp)),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=interruptible,  # noqa: PLW1509 - only sets a signal disposition before exec
    )


@pytest.mark.slow
def test_up_serves_submit_job_and_timeline_then_stops_cleanly_on_ctrl_c(tmp_path: Path, private_tmp: Path) -> None:
    up = _up(private_tmp)
    try:
        assert up.stdout is not None
        exports: dict[str, str] = {}
        line = ""
        while not exports or line.startswith("export "):  # the URLs, then the signing key: the services verify
            line = up.stdout.readline()
            assert line, "lanes up exited before printing its URLs"
            if line.startswith("export "):
                name, _, value = line.removeprefix("export ").strip().partition("=")
                exports[name] = value
        env = _env(**exports)
        spec = tmp_path / "job.yaml"
        spec.write_text("job_id: cli-job-1\nname: cli-job\nworkers: 3\ngpus_per_worker: 2\n")
        submitted = _lanes("submit", str(spec), env=env)
        assert submitted.returncode == 0, submitted.stderr
        assert json.loads(submitted.stdout)["job_id"] == "cli-job-1"
        again = _lanes("submit", str(spec), env=env)
        assert json.loads(again.stdout)["seq"] == json.loads(submitted.stdout)["seq"]  # de-duplicated

        deadline = time.monotonic() + 60
        while True:
            shown = _lanes("job", "cli-job-1", "--json", env=env)
            if shown.returncode == 0 and json.loads(shown.stdout)["state"] == "released":
                break
            assert time.monotonic() < deadline, shown.stdout + shown.stderr
            time.sleep(0.2)
        timeline = _lanes("timeline", "cli-job-1", "--json", env=env)
        assert timeline.returncode == 0, timeline.stderr
        events = json.loads(timeline.stdout)["timeline"]
        assert sum(e["type"] == "io.lanes.job.rank_exited.v1" for e in events) == 3
        assert sum(e["type"] == "io.lanes.job.submitted.v1" for e in events) == 1
        # The text header says what the job's own transitions say (it said "state unknown attempts -").
        text = _lanes("timeline", "cli-job-1", env=env)
        assert "state released  attempts #1 released" in text.stdout, text.stdout[:500]
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=30)
    assert up.returncode == 0
    _gone(private_tmp)


@pytest.mark.slow
def test_up_stops_on_ctrl_c_right_after_it_starts(private_tmp: Path) -> None:
    # A Ctrl-C before the router listened used to leave `lanes up` waiting for the router's address forever.
    up = _up(private_tmp)
    try:
        assert up.stdout is not None
        for line in up.stdout:
            if "Ctrl-C to stop" in line:
                break
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
    assert up.returncode == 0
    _gone(private_tmp)


@pytest.mark.slow
def test_bad_input_gets_a_one_line_error_and_a_meaningful_exit_code(tmp_path: Path, servers: ServerUrls) -> None:
    env = _env(NATS_URL=servers.nats_url, DATABASE_URL=servers.database_url, REDIS_URL=servers.redis_url)
    missing = _lanes("submit", str(tmp_path / "nope.yaml"), env=env)
    assert missing.returncode == 2
    assert "cannot read" in missing.stderr

    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("name: [unclosed\n")
    assert _lanes("submit", str(bad_yaml), env=env).returncode == 2

    bad_field = tmp_path / "field.yaml"
    bad_field.write_text("name: ok\nworkers: 0\n")
    result = _lanes("submit", str(bad_field), env=env)
    assert result.returncode == 2
    assert "workers" in result.stderr
    assert "Traceback" not in result.stderr

    unknown = _lanes("timeline", "no-such-job", env=env)
    assert unknown.returncode == 3
    assert "unknown job" in unknown.stderr

    assert _lanes("serve", "nonsense", env=env).returncode == 2


def test_an_unreachable_server_exits_4() -> None:
    result = _lanes("timeline", "x", env=_env(NATS_URL="nats://127.0.0.1:1"), timeout=60)
    assert result.returncode == 4
    assert "cannot reach NATS" in result.stderr


async def test_an_old_nats_is_refused_by_the_cli() -> None:
    async with server_announcing("2.9.10") as url:
        result = await asyncio.to_thread(_lanes, "timeline", "x", env=_env(NATS_URL=url), timeout=60)
    assert result.returncode == 4
    assert "too old" in result.stderr
