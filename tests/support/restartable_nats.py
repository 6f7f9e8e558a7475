"""A real nats-server that a test can stop (the process ends, not paused) and start again on the same port.

`EmbeddedNats` is made once and removed on stop; an outage test needs the same address and the same
JetStream store to come back, as a restarted server in production does. No authentication: the test's
clients and a `lanes agent` connect with the plain URL.
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path
from types import TracebackType
from typing import Self

from lanes_sandbox.nats_server import _find_nats
from support.ports import free_port
from support.waiting import eventually_in_sync_code

_READY_S = 30.0


class RestartableNats:
    """nats-server with JetStream on one fixed loopback port, its store in `directory`."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self.port = free_port()
        self._server: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The server's URL, the same across restarts."""
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the server (again) on its port and store; return once it accepts clients."""
        self._directory.mkdir(parents=True, exist_ok=True)
        command = [str(_find_nats().path), "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self._directory)]
        with (self._directory / "nats.log").open("ab") as log:
            self._server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        eventually_in_sync_code(self._accepts, timeout_s=_READY_S, what=f"nats-server on port {self.port}")

    def stop(self) -> None:
        """Stop the server: the process ends (SIGTERM, JetStream flushed), its port refuses connections."""
        if self._server is not None and self._server.poll() is None:
            self._server.terminate()
            self._server.wait(timeout=_READY_S)
        self._server = None

    def _accepts(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                return sock.recv(5) == b"INFO "
        except OSError:
            return False

    def __enter__(self) -> Self:
        """Start the server."""
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        """Stop it, whatever ended the block."""
        self.stop()
