"""Real faults for `lanes drill`, injected into a rank's process on this host.

Each kind does what the fault does on a real node, so the evidence that follows is the real evidence:
- `kill`: SIGKILL, as an operator's `kill -9` or a watchdog would;
- `hang`: SIGSTOP (SIGCONT after `duration_s`, if given); the peers wait in their collective and time out;
- `slow`: SIGSTOP and SIGCONT in turn (every 50 ms) for `duration_s`: a straggler that is not dead;
- `oom`: the rank's memory cgroup limit lowered to what it uses; what it allocates next is over it, and the
  kernel's OOM killer kills it and logs its real line;
- `xid`: an NVRM Xid 94 line (a contained ECC error, which names the process) written to the kernel log for
  the rank's pid, then the drill workload's fault hook (SIGUSR2) fails its next step as the CUDA call after
  an ECC error fails. The one simulated part, since no GPU is here: the kernel line;
- `exception`: the drill workload's fault hook (SIGUSR1) raises an exception at its next step;
- `link-down`: the node's link (its veth on the bridge, `lanes up --netns`) down, and up after `duration_s`;
- `link-slow`: the node's link rate-limited both ways (`netns.shape_link`, a token bucket on each end of its
  veth) for `duration_s`, then its full rate back: a degraded link that fails nothing.

The drill runs on the rank's host (the simulated nodes of `lanes up` share one).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from lanes_agent import netns
from lanes_agent.cgroups import MemoryCgroups
from lanes_contract.events import DrillKind

KMSG = Path("/dev/kmsg")
MEMORY_CONTROLLER = Path("/sys/fs/cgroup/memory")
EXCEPTION_SIGNAL = signal.SIGUSR1
"""The drill workload raises an exception at its next step when it receives this."""
CUDA_FAILURE_SIGNAL = signal.SIGUSR2
"""The drill workload fails its next step as a CUDA call fails after a GPU fault when it receives this."""
_SLOW_PERIOD_S = 0.1
_SLOW_STOPPED = 0.5
"""Of each tenth of a second of a slow-down, the rank is stopped this fraction: short enough that every step
of a training run is slowed (a throttled GPU, a noisy neighbour), not one step in ten stalled."""


class FaultError(RuntimeError):
    """The fault cannot be injected here (no such process, no cgroup, no kernel log); the message says why."""


@dataclass(frozen=True)
class Injected:
    """How a fault was injected, for the drill's event."""

    detail: str


def kernel_faults_unavailable(kmsg: Path = KMSG) -> str | None:
    """Why an OOM kill and a kernel line cannot go through this host's kernel, or None when they can.

    Needs memory cgroups (the kernel's OOM killer acts on a rank's limit) and a kernel log that the agent
    reads and a drill writes.
    """
    if why := MemoryCgroups().unavailable():
        return why
    if not os.access(kmsg, os.R_OK | os.W_OK):
        return f"{kmsg} cannot be read and written (root)"
    return None


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError as exc:
        msg = f"process {pid} is not running on this host (has the rank exited, or does it run elsewhere?)"
        raise FaultError(msg) from exc


def memory_cgroup_of(pid: int) -> Path:
    """The memory cgroup directory process `pid` runs in (cgroup v1)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError as exc:
        raise FaultError(f"process {pid} is not running on this host") from exc
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            group = MEMORY_CONTROLLER / path.lstrip("/")
            if path in {"", "/"} or not (group / "memory.limit_in_bytes").exists():
                break
            return group
    msg = f"process {pid} has no memory cgroup of its own (set host_memory_gib in the job's spec, as root)"
    raise FaultError(msg)


def write_kernel_line(line: str, kmsg: Path = KMSG) -> None:
    """Append one record to the kernel log (root); the kernel stamps it with its sequence and time."""
    try:
        with kmsg.open("w") as log:
            log.write(f"<3>{line}\n")  # complete at its newline
    except OSError as exc:
        raise FaultError(f"cannot write {kmsg}: {exc.strerror or exc}") from exc


def xid_line(pid: int, gpu: str = "0000:3b:00") -> str:
    """The NVRM line of a contained ECC error (Xid 94) in the process `pid`."""
    return f"NVRM: Xid (PCI:{gpu}): 94, pid={pid}, name=python, Contained: SM (0x1). RST: No, D-RST: No"


async def inject(
    kind: DrillKind, pid: int, *, node: str = "", duration_s: float | None = None, kmsg: Path = KMSG
) -> Injected:
    """Inject `kind` into process `pid` (on `node`); one with a duration returns once it is over."""
    match kind:
        case DrillKind.LINK_DOWN:
            return await _cut_link(node, duration_s)
        case DrillKind.LINK_SLOW:
            return await _degrade_link(node, duration_s or 10.0)
        case DrillKind.KILL:
            _signal(pid, signal.SIGKILL)
            return Injected("SIGKILL")
        case DrillKind.HANG:
            _signal(pid, signal.SIGSTOP)
            if duration_s is None:
                return Injected("SIGSTOP, never resumed")
            await asyncio.sleep(duration_s)
            _signal(pid, signal.SIGCONT)
            return Injected(f"SIGSTOP, SIGCONT after {duration_s:g} s")
        case DrillKind.SLOW:
            return await _slow(pid, duration_s or 10.0)
        case DrillKind.OOM:
            return _squeeze(memory_cgroup_of(pid))
        case DrillKind.XID:
            line = xid_line(pid)
            write_kernel_line(line, kmsg)
            _signal(pid, CUDA_FAILURE_SIGNAL)
            return Injected(f"kernel line {line!r}, then {CUDA_FAILURE_SIGNAL.name} (the next CUDA call fails)")
        case DrillKind.EXCEPTION:
            _signal(pid, EXCEPTION_SIGNAL)
            return Injected(f"{EXCEPTION_SIGNAL.name} (the workload's fault hook raises)")
    msg = f"unknown drill kind {kind!r}"
    raise FaultError(msg)


def _squeeze(group: Path, tries: int = 20) -> Injected:
    """Lower the cgroup's limit to what it uses now, so what it allocates next is over it.

    The kernel first reclaims the cgroup's page cache, then (no swap here) kills the rank: the kernel's own
    OOM kill. It refuses (EBUSY) a limit below what it cannot reclaim, so the limit follows the use as it moves.
    """
    for _ in range(tries):
        used = int((group / "memory.usage_in_bytes").read_text())
        try:
            (group / "memory.limit_in_bytes").write_text(str(used))
        except OSError:
            continue  # it grew between the read and the write: read again
        return Injected(f"memory limit of cgroup {group.name} lowered to its use, {used} bytes")
    msg = f"cannot lower the memory limit of {group}: its use keeps moving"
    raise FaultError(msg)


async def _cut_link(node: str, duration_s: float | None) -> Injected:
    if netns.link_is_up(node) is None:
        msg = f"{node} has no link of its own here (run the nodes in network namespaces: lanes up --netns)"
        raise FaultError(msg)
    netns.set_link(node, up=False)
    if duration_s is None:
        return Injected(f"link {netns.link_of(node)} of {node} down, never restored")
    await asyncio.sleep(duration_s)
    netns.set_link(node, up=True)
    return Injected(f"link {netns.link_of(node)} of {node} down for {duration_s:g} s")


async def _degrade_link(node: str, duration_s: float) -> Injected:
    if netns.link_is_up(node) is None:
        msg = f"{node} has no link of its own here (run the nodes in network namespaces: lanes up --netns)"
        raise FaultError(msg)
    try:
        netns.shape_link(node)
    except (OSError, subprocess.CalledProcessError) as exc:
        netns.unshape_link(node)  # one end shaped, the other refused: leave neither
        why = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) and exc.stderr else str(exc)
        raise FaultError(f"cannot shape the link of {node}: {why}") from exc
    try:
        await asyncio.sleep(duration_s)
    finally:
        netns.unshape_link(node)  # a drill cancelled half-way still gives the link back
    link = netns.link_of(node)
    return Injected(f"link {link} of {node} limited to {netns.SLOW_RATE}/s both ways for {duration_s:g} s")


async def _slow(pid: int, duration_s: float) -> Injected:
    loop = asyncio.get_running_loop()
    end = loop.time() + duration_s
    try:
        while loop.time() < end:
            _signal(pid, signal.SIGSTOP)
            await asyncio.sleep(_SLOW_PERIOD_S * _SLOW_STOPPED)
            _signal(pid, signal.SIGCONT)
            await asyncio.sleep(_SLOW_PERIOD_S * (1 - _SLOW_STOPPED))
    finally:
        with_pid_gone = False
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            with_pid_gone = True
    stopped = "; the rank ended during it" if with_pid_gone else ""
    return Injected(f"SIGSTOP/SIGCONT duty cycle ({_SLOW_STOPPED:.0%} stopped) for {duration_s:g} s{stopped}")
