"""A real one-node Slurm cluster for tests: munged, slurmctld and slurmd (Debian's packages) on this machine.

Everything lives in a temporary directory: the munge key and socket, `slurm.conf` (free ports, root as
SlurmUser, no accounting, job credentials that expire after 5 s so a requeued job may start again
after 6 s rather than the default 2 minutes), state and logs. `SLURM_CONF` in `env` points the clients (sbatch, squeue,
scontrol, sinfo) at it. On exit every job is cancelled, then the daemons are stopped, each in its own
process group, and the directory is removed: nothing is left running.

slurmd runs jobs as their user, so it needs root; `available()` says why a cluster cannot start here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Self

_DAEMONS = ("munged", "slurmctld", "slurmd")
_CLIENTS = ("sbatch", "squeue", "sinfo", "scontrol", "scancel", "srun")
_START_TIMEOUT_S = 60.0
_STOP_TIMEOUT_S = 30.0


def available() -> str | None:
    """Why a Slurm cluster cannot run here (None when it can)."""
    missing = [name for name in (*_DAEMONS, *_CLIENTS) if shutil.which(name) is None]
    if missing:
        return f"Slurm is not installed (missing {', '.join(missing)}): apt-get install slurmctld slurmd munge"
    if os.geteuid() != 0:
        return "slurmd runs jobs as their user and needs root"
    return None


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class SlurmCluster:
    """One partition `debug` of one node `node_name` with `cpus` CPUs; jobs run on this machine."""

    def __init__(self, *, node_name: str = "slurm-n1", cpus: int = 2) -> None:
        self.node_name = node_name
        self.cpus = cpus
        self.directory = Path(tempfile.mkdtemp(prefix="lanes-slurm-"))
        self.env = dict(os.environ) | {"SLURM_CONF": str(self.directory / "slurm.conf")}
        self._procs: list[subprocess.Popen[bytes]] = []

    # --- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> Self:
        """Start munged, slurmctld and slurmd; return once the node takes jobs."""
        try:
            self._configure()
            self._spawn("munged", "-F", "-f", *self._munge_args())
            self._wait((self.directory / "munge.sock").exists, "munged's socket")
            self._spawn("slurmctld", "-D", "-i")
            self._spawn("slurmd", "-D", "-N", self.node_name)
            self._wait(self._node_ready, f"node {self.node_name} idle")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Cancel every job, stop the daemons (slurmd first), remove the directory."""
        if self._procs and self._procs[-1].poll() is None:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                self.run("scancel", "--full", "--user", "root")
                self._wait(self._no_job_runs, "jobs to end", timeout_s=_STOP_TIMEOUT_S, must=False)
        for proc in reversed(self._procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=_STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        self._procs.clear()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # --- clients -----------------------------------------------------------------------------------

    def run(self, *command: str, env: dict[str, str] | None = None) -> str:
        """A Slurm client command against this cluster; its stdout (raises with stderr when it fails)."""
        done = subprocess.run(  # noqa: S603 - Slurm's own clients, arguments from the tests
            command, env=self.env | (env or {}), capture_output=True, text=True, check=False, timeout=60
        )
        if done.returncode != 0:
            msg = f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}"
            raise subprocess.SubprocessError(msg)
        return done.stdout

    def sbatch(self, *args: str) -> int:
        """Submit a batch job; its Slurm job id."""
        return int(self.run("sbatch", "--parsable", *args).strip().split(";")[0])

    def job(self, slurm_id: int) -> dict[str, Any]:
        """`squeue --json`'s entry for one job."""
        jobs: list[dict[str, Any]] = json.loads(self.run("squeue", "--json", "--all"))["jobs"]
        return next(job for job in jobs if int(job["job_id"]) == slurm_id)

    def wait_job(self, slurm_id: int, states: set[str], timeout_s: float = 60.0) -> dict[str, Any]:
        """Wait until the job is in one of `states`; its squeue entry."""
        self._wait(lambda: self.job(slurm_id)["job_state"] in states, f"job {slurm_id} in {sorted(states)}", timeout_s)
        return self.job(slurm_id)

    # --- internals ---------------------------------------------------------------------------------

    def _munge_args(self) -> list[str]:
        d = self.directory
        return [
            f"--socket={d / 'munge.sock'}",
            f"--key-file={d / 'munge.key'}",
            f"--log-file={d / 'munged.log'}",
            f"--pid-file={d / 'munged.pid'}",
            f"--seed-file={d / 'munged.seed'}",
        ]

    def _configure(self) -> None:
        d = self.directory
        d.chmod(0o755)  # munged refuses a socket directory others cannot traverse
        for sub in ("state", "spool"):
            (d / sub).mkdir()
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        ctld_port, slurmd_port = _free_ports(2)
        host = socket.gethostname()
        (d / "slurm.conf").write_text(
            f"""ClusterName=lanes
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d / "munge.sock"},cred_expire=5
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d / "state"}
SlurmdSpoolDir={d / "spool"}
SlurmctldPidFile={d / "slurmctld.pid"}
SlurmdPidFile={d / "slurmd.pid"}
SlurmctldLogFile={d / "slurmctld.log"}
SlurmdLogFile={d / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerParameters=sched_interval=1
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MinJobAge=600
NodeName={self.node_name} NodeHostname={host} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes={self.node_name} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _spawn(self, *command: str) -> None:
        log = (self.directory / f"{command[0]}.out").open("wb")
        self._procs.append(
            subprocess.Popen(  # noqa: S603 - the Slurm and munge daemons, fixed arguments
                command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
        log.close()

    def _node_ready(self) -> bool:
        with contextlib.suppress(subprocess.SubprocessError, OSError, ValueError, KeyError):
            nodes = json.loads(self.run("sinfo", "--json"))["nodes"]
            return any(n["name"] == self.node_name and n["state"] == "idle" for n in nodes)
        return False

    def _no_job_runs(self) -> bool:
        states = self.run("squeue", "-h", "-t", "RUNNING,COMPLETING,CONFIGURING", "-o", "%i")
        return not states.strip()

    def _wait(self, check: Any, what: str, timeout_s: float = _START_TIMEOUT_S, *, must: bool = True) -> None:
        deadline = time.monotonic() + timeout_s
        pause = 0.05
        while not check():
            for proc in self._procs:
                if proc.poll() is not None and must:
                    logs = {p.name: p.read_text()[-2000:] for p in self.directory.glob("*.out")}
                    msg = f"{proc.args!r} exited ({proc.returncode}) while waiting for {what}: {logs}"
                    raise RuntimeError(msg)
            if time.monotonic() > deadline:
                if must:
                    msg = f"timed out after {timeout_s:.0f} s waiting for {what}"
                    raise TimeoutError(msg)
                return
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
