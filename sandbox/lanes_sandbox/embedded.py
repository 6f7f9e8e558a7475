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

import logging
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import TYPE_CHECKING, Final, Self, TypeVar

from lanes_runtime.settings import ServerUrls
from lanes_sandbox._process import (
    _REAPER,
    _STOP_GRACE_SECONDS,
    DEFAULT_STARTUP_TIMEOUT,
    EmbeddedServerError,
    _ReaperClient,
    _ServerBase,
    dies_with_this_process,
)
from lanes_sandbox.nats_server import DEFAULT_AGENT_NODES, KEYRING_FILE, EmbeddedNats, EmbeddedNatsCluster
from lanes_sandbox.postgres_server import EmbeddedPostgres
from lanes_sandbox.redis_server import EmbeddedRedis

if TYPE_CHECKING:
    from types import TracebackType

_LOG: Final = logging.getLogger(__name__)

_S = TypeVar("_S", bound=_ServerBase)

__all__ = [
    "DEFAULT_AGENT_NODES",
    "DEFAULT_STARTUP_TIMEOUT",
    "KEYRING_FILE",
    "EmbeddedNats",
    "EmbeddedNatsCluster",
    "EmbeddedPostgres",
    "EmbeddedRedis",
    "EmbeddedServerError",
    "EmbeddedStack",
    "ServerUrls",
    "dies_with_this_process",
]


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
