"""What every embedded server shares: ports, versions, the spawner, the reaper client, the server base.

The base class starts a server, waits until it is ready, stops it cleanly and cleans up after it; see
`lanes_sandbox.embedded` for the guarantees.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import json
import logging
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, Self, TypeVar, cast

from lanes_sandbox import _reaper

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from types import TracebackType

_LOG: Final = logging.getLogger(__name__)

_HOST: Final = "127.0.0.1"
#: Default bound on how long one server may take to become ready.
DEFAULT_STARTUP_TIMEOUT: Final = 30.0
#: How long a server gets to exit after its clean-stop signal before SIGKILL.
_STOP_GRACE_SECONDS: Final = 10.0
_PORT_ATTEMPTS: Final = 5
_PROBE_TIMEOUT: Final = 1.0
_LOG_TAIL_LINES: Final = 40

_T = TypeVar("_T")


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
        self._relaunch: Callable[[], subprocess.Popen[bytes]] | None = None
        """Starts the server again as it was started, on its port, with its data (for `restart`)."""

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

    def kill(self) -> None:
        """SIGKILL the server, as a crash would, keeping its directory and data for `restart`."""
        proc = self._server
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        self._finish(proc)

    def restart(self) -> None:
        """Start a killed server again, on its port, with its data (a running one is left alone)."""
        with self._lock:
            if self._relaunch is None or not self._started:
                msg = f"embedded {self._kind} is not running: start it, not restart it"
                raise EmbeddedServerError(msg)
            if self._server is not None and self._server.poll() is None:
                return
            self._server = self._relaunch()

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
            self._relaunch = functools.partial(attempt, port)
            return
        msg = f"embedded {self._kind}: no free port after {_PORT_ATTEMPTS} attempts:\n{last}"
        raise EmbeddedServerError(msg)


def dies_with_this_process(death_signal: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel send ``death_signal`` to the child when this process dies (Linux).

    For children started from a thread that lives as long as the process (its main thread): the signal fires
    when the forking thread exits. None where there is no such signal.
    """
    return _death_signal_preexec(death_signal, os.getpid())
