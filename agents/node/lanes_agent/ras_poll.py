"""Asking NCCL's RAS about a job whose collective stalls (`lanes agent --ras`).

NCCL 2.24 and later run a RAS thread in every process of a job; `ncclras` on any node of the job asks it for
the communicators, their op counts and the ranks that are missing, dead or behind. Nobody runs it while the
job is still hanging, which is the only time its answer is worth most: by the time the watchdog kills the
ranks, the counts are gone. So an agent started with `--ras` runs it itself, once per attempt, when one of
its ranks says its collective timed out or stops making steps for `stall_s` seconds.

The agent speaks only for its own node: RAS's answer about ranks elsewhere is published as what this node's
RAS client said (its own node's subject, the ranks RAS named), never as those nodes' evidence.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
from dataclasses import dataclass

import structlog

from lanes_evidence.evidence import Evidence
from lanes_evidence.parsers import SourceContext
from lanes_evidence.ras import is_ras_report, parse_ras, ras_evidence

log = structlog.get_logger(__name__)

DEFAULT_RAS_COMMAND = "ncclras"
RAS_STALL_S = 60.0
"""A rank that made no step for this long is stalled (well under the NCCL watchdog's default ten minutes)."""
RAS_TIMEOUT_S = 30.0
MAX_RAS_OUTPUT = 4 * 1024 * 1024
"""A report is a few kilobytes per communicator; an answer past this is cut, not read into memory whole."""


@dataclass(frozen=True)
class RasPolling:
    """How an agent asks RAS: the client's command line, when a rank counts as stalled, how long to wait."""

    command: tuple[str, ...] = (DEFAULT_RAS_COMMAND,)
    stall_s: float = RAS_STALL_S
    timeout_s: float = RAS_TIMEOUT_S

    @classmethod
    def from_command_line(cls, command: str, *, stall_s: float = RAS_STALL_S) -> RasPolling:
        """Polling with `command` split as a shell would (`ncclras -p 28029` is a command and its flags)."""
        words = tuple(shlex.split(command))
        if not words:
            msg = "the RAS command is empty"
            raise ValueError(msg)
        return cls(command=words, stall_s=stall_s)


class StallWatch:
    """When a rank's steps stop: armed by each step, it fires once per silence of `stall_s` seconds.

    A rank that has made no step yet is not watched: starting up (loading data, compiling) is not a stall.
    """

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self._last_step: float | None = None

    def stepped(self, now: float) -> None:
        """The rank reported a step: it is moving (again)."""
        self._last_step = now

    def stalled(self, now: float) -> float | None:
        """The seconds the rank has been silent, the first time it passes `stall_s` (then None until a step)."""
        if self._last_step is None or now - self._last_step < self.stall_s:
            return None
        silent, self._last_step = now - self._last_step, None
        return silent


async def ask_ras(polling: RasPolling, context: SourceContext) -> list[Evidence]:
    """Run the RAS client and read its report as evidence; a client that cannot answer is logged, not raised.

    The report's ranks are kept; its nodes are not: the evidence is the asking node's (`context.node`).
    """
    try:
        proc = await asyncio.create_subprocess_exec(
            *polling.command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
    except OSError as exc:
        log.warning("the NCCL RAS client cannot be run", command=polling.command[0], error=str(exc))
        return []
    try:
        out, err = await asyncio.wait_for(proc.communicate(), polling.timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        log.warning("the NCCL RAS client did not answer", command=polling.command[0], timeout_s=polling.timeout_s)
        return []
    text = out[:MAX_RAS_OUTPUT].decode(errors="replace")
    if proc.returncode != 0 or not is_ras_report(text):
        problem = err.decode(errors="replace").strip()[-512:] or text.strip()[:512]
        log.warning("the NCCL RAS client gave no report", exit_code=proc.returncode, said=problem)
        return []
    found = ras_evidence(parse_ras(text), context)
    # The asking node's word about those ranks: the ranks stay, the node is the one that asked.
    return [Evidence(data=e.data, time=e.time, node=context.node, rank=e.rank) for e in found]
