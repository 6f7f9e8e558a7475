"""Replicas of every service, each a process of its own (`lanes serve <service>`), as `lanes up --replicas` runs.

Each process connects as its service's identity, signs with that identity's key and verifies with the keyring,
as a container of the compose stack does; several processes of one service share its durable consumers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from lanes_cli.bootstrap import SERVICES
from lanes_cli.stack import embedded_credentials, identity_url
from lanes_contract.client import SIGNING_KEY_ENV
from lanes_contract.signing import KEYRING_ENV
from lanes_runtime.settings import ServerUrls
from lanes_sandbox.embedded import KEYRING_FILE, dies_with_this_process

log = structlog.get_logger(__name__)

SUPERVISE_EVERY_S: Final = 1.0
"""How often `supervise` looks for exited replicas."""
STOP_GRACE_S: Final = 15.0
"""How long a replica gets to stop after SIGTERM (its batches finish, its acks go out) before SIGKILL."""
_SERVE: Final = ("-c", "from lanes_cli.cli import main; main()", "serve")


@dataclass
class Replica:
    """One running process of a service."""

    service: str
    index: int
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def name(self) -> str:
        """`<service>-<index>`, as logs and the fault checker name it."""
        return f"{self.service}-{self.index}"

    @property
    def pid(self) -> int:
        """Its process id."""
        return self.process.pid

    @property
    def exit_code(self) -> int | None:
        """Its exit code (negative: the signal that ended it), None while it runs."""
        return self.process.poll()

    @property
    def alive(self) -> bool:
        """Whether it still runs."""
        return self.process.poll() is None


@dataclass(frozen=True)
class ReplicaEnv:
    """What every replica is given: the servers (the bus per identity), the keys, and anything else."""

    url_for: Callable[[str], str]
    """The NATS URL (every server of a cluster) that connects as an identity."""
    database_url: str
    redis_url: str
    stream_replicas: int
    credentials: Path | None
    """The embedded NATS's credentials directory (signing keys and the keyring); None: the environment's."""
    extra: Mapping[str, str]
    per_replica: Callable[[str, int], Mapping[str, str]] | None = None
    """What one replica (service, index) is given besides, e.g. a metrics port of its own."""

    def for_replica(self, service: str, index: int) -> dict[str, str]:
        """The environment of replica `index` of `service`."""
        env = dict(os.environ) | dict(self.extra)
        if self.per_replica is not None:
            env |= self.per_replica(service, index)
        env |= {
            "NATS_URL": self.url_for(service),
            "DATABASE_URL": self.database_url,
            "REDIS_URL": self.redis_url,
            "LANES_STREAM_REPLICAS": str(self.stream_replicas),
            "LANES_LOG_FORMAT": "json",
            # Replicas of the router each take a free port (their URLs are in their logs).
            "LANES_ROUTER_PORT": "0",
        }
        if self.credentials is not None:
            env[SIGNING_KEY_ENV] = str(self.credentials / f"{service}.key")
            env[KEYRING_ENV] = str(self.credentials / KEYRING_FILE)
        return env


class ServiceReplicas:
    """`count` processes of each service, started together, restarted on demand, stopped with SIGTERM."""

    def __init__(self, services: Iterable[str], count: int, env: ReplicaEnv, log_dir: Path) -> None:
        """Prepare (not start) the replicas; their logs go to `log_dir/<service>-<index>.log`."""
        self._services = tuple(services)
        self._count = count
        self._env = env
        self.log_dir = log_dir
        self.replicas: list[Replica] = []
        self.restarts: list[tuple[str, int | None]] = []
        """Each restart by `supervise`: the replica's name and the exit code it had."""

    def start(self) -> None:
        """Start every replica (they provision their consumers and migrations themselves, idempotently)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for service in self._services:
            for index in range(1, self._count + 1):
                self.replicas.append(self._spawn(service, index))
        log.info("service replicas started", services=list(self._services), replicas=self._count)

    def _spawn(self, service: str, index: int) -> Replica:
        path = self.log_dir / f"{service}-{index}.log"
        with path.open("ab") as out:
            process = subprocess.Popen(  # noqa: S603 - this interpreter, a fixed command
                [sys.executable, *_SERVE, service],
                env=self._env.for_replica(service, index),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                # Own session: a Ctrl-C at the terminal reaches `lanes up`, which stops them in order.
                start_new_session=True,
                # SIGKILL: an orphan's graceful stop may wait on servers that went with its parent; its work is
                # redone by the next replica anyway (a crash at any point loses nothing).
                preexec_fn=dies_with_this_process(signal.SIGKILL),  # noqa: PLW1509 - only calls a pre-resolved prctl
            )
        return Replica(service, index, process, path)

    def restart(self, replica: Replica) -> Replica:
        """Start a dead replica again under the same name (the fault checker's kill -9 is followed by this)."""
        if replica.alive or replica not in self.replicas:
            return replica
        replica.process.wait()
        fresh = self._spawn(replica.service, replica.index)
        self.replicas[self.replicas.index(replica)] = fresh
        return fresh

    async def supervise(self, stop: asyncio.Event) -> None:
        """Start again every replica that exited, until `stop`, as a container's restart policy does.

        A service process exits when it cannot start (a server away while it connects) or fails for good; the
        compose stack and Kubernetes start it again, and so does this. Each restart is counted and logged.
        """
        while not stop.is_set():
            for replica in self.dead():
                log.warning("service replica exited; starting it again", replica=replica.name, code=replica.exit_code)
                self.restarts.append((replica.name, replica.exit_code))
                self.restart(replica)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), SUPERVISE_EVERY_S)

    def dead(self) -> list[Replica]:
        """The replicas whose process exited."""
        return [replica for replica in self.replicas if not replica.alive]

    def stop(self) -> None:
        """SIGTERM every replica, wait for them, SIGKILL any still running after the grace."""
        for replica in self.replicas:
            with contextlib.suppress(ProcessLookupError):
                replica.process.send_signal(signal.SIGTERM)
        for replica in self.replicas:
            try:
                replica.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                log.warning("service replica ignored SIGTERM; killing it", replica=replica.name)
                replica.process.kill()
                replica.process.wait()

    async def beside(self, stop: asyncio.Event, *work: Awaitable[object]) -> None:
        """Run (and restart) the replicas while `work` runs (a launcher, a console), until `stop`."""
        with self.running():
            log.info("service replica logs", directory=str(self.log_dir))
            await asyncio.gather(self.supervise(stop), *work)

    @contextlib.contextmanager
    def running(self, *, keep_logs: bool = False) -> Iterator[ServiceReplicas]:
        """Start them for the block, stop them after it, whatever ended it; their logs are removed then, unless kept."""
        try:
            self.start()
            yield self
        finally:
            self.stop()
            if not keep_logs:
                shutil.rmtree(self.log_dir, ignore_errors=True)


MIN_CLUSTER: Final = 3
"""The fewest NATS servers of a cluster that keeps a quorum with one of them down."""


def cluster_problem(size: int, *, nats_url_given: bool) -> str | None:
    """Why `lanes up --cluster size` cannot run (a one-line refusal), or None when it can (0: no cluster)."""
    if not size:
        return None
    if size < MIN_CLUSTER or size % 2 == 0:
        return f"--cluster takes 3 or 5 servers (a quorum survives one or two of them down), not {size}"
    if nats_url_given:
        return "--cluster embeds its NATS servers, and NATS_URL names one already: unset it, or drop --cluster"
    return None


def service_replicas(urls: ServerUrls, count: int, stream_replicas: int) -> ServiceReplicas:
    """`count` processes of every service against these servers (the embedded ones' identities and keys).

    Their logs go to a fresh temporary directory, removed when they stop.
    """
    return ServiceReplicas(
        SERVICES,
        count,
        ReplicaEnv(
            lambda identity: identity_url(identity, urls.nats_url),
            urls.database_url,
            urls.redis_url,
            stream_replicas,
            embedded_credentials(),
            {},
        ),
        Path(tempfile.mkdtemp(prefix="lanes-replicas-")),
    )
