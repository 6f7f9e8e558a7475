"""What a rank's output says beside its evidence: readiness, the endpoint it serves on, steps and checkpoints.

The node agent tails every rank's stdout and stderr; these are the lines it recognises as the rank's own
reports rather than as evidence for telemetry (Lanes' markers, NCCL's `Init COMPLETE`, a server's "running on"
line), and the batching that keeps a step a millisecond from becoming an event a millisecond.
"""

from __future__ import annotations

import re

import structlog

from lanes_contract.events import CheckpointSavedData, HeartbeatData, StepTiming
from lanes_contract.events.progress import MAX_TIMINGS

log = structlog.get_logger(__name__)

LOOPBACK = "127.0.0.1"
"""The address of a simulated node that shares the host's network."""
READY_MARKER = "lanes: communicator ready"
"""A rank prints this line once its collective communicator is initialised; the launcher reports it."""
_LISTENING = re.compile(r"Uvicorn running on (?P<scheme>https?)://(?P<host>[^\s:/]+):(?P<port>\d+)")
"""The line an OpenAI-compatible server (vLLM, the toy replica) prints once it accepts requests."""
_STEP = re.compile(
    r"^lanes: step (?P<step>\d+)(?: compute_s=(?P<compute>\d+(?:\.\d+)?) wait_s=(?P<wait>\d+(?:\.\d+)?))?\s*$"
)
TIMINGS_EVERY_S = 1.0
"""A rank's step timings travel in one heartbeat at most this often (a step a millisecond is not an event a
millisecond); what is left is sent when its output ends."""
_CHECKPOINT = re.compile(r"^lanes: checkpoint saved (?P<fields>(?:\w+=\S+\s*)+)$")
_CHECKPOINT_FIELDS = frozenset({"step", "path", "digest", "model_version", "data_version", "config_version", "image"})


_NCCL_READY = re.compile(r"NCCL INFO comm 0x[0-9a-f]+ rank \d+ nranks \d+ .*- Init COMPLETE")
"""NCCL's own line (NCCL_DEBUG=INFO) once a rank's communicator is initialised."""


def communicator_ready(line: str) -> str | None:
    """The backend whose communicator this line says is ready ("" for Lanes' own marker), or None.

    An unmodified workload says so in its own words: NCCL's `Init COMPLETE` line under NCCL_DEBUG=INFO.
    """
    if line.strip() == READY_MARKER:
        return ""
    return "nccl" if _NCCL_READY.search(line) else None


def listening_endpoint(line: str, node_address: str = LOOPBACK) -> str | None:
    """The endpoint a server's "running on" line announces; a wildcard host becomes the node's address."""
    found = _LISTENING.search(line)
    if found is None:
        return None
    host = node_address if found["host"] in {"0.0.0.0", "::", "[::]"} else found["host"]  # noqa: S104 - parsed, not bound
    return f"{found['scheme']}://{host}:{found['port']}"


def progress_report(line: str) -> HeartbeatData | CheckpointSavedData | None:
    """A rank's progress line: a step (`lanes: step N [compute_s=C wait_s=W]`) or a saved checkpoint.

    A checkpoint reads `lanes: checkpoint saved step=N path=P digest=D [versions]`. These are the lines a
    training script's Lanes hook prints. The versions it trained with travel with the checkpoint, so recovery
    can refuse to resume a run from a checkpoint of another model, data or config; a step's timing (seconds
    computing, seconds waiting in collectives) is what telemetry reads for slow ranks and degraded links.
    """
    if step := _STEP.match(line.strip()):
        if step["compute"] is None:
            return HeartbeatData(step=int(step["step"]))
        timing = StepTiming(step=int(step["step"]), compute_s=float(step["compute"]), wait_s=float(step["wait"]))
        return HeartbeatData(step=timing.step, timings=(timing,))
    if saved := _CHECKPOINT.match(line.strip()):
        fields = dict(pair.split("=", 1) for pair in saved["fields"].split())
        unknown = set(fields) - _CHECKPOINT_FIELDS
        if unknown:
            msg = f"unknown checkpoint field(s) {sorted(unknown)} in {line.strip()!r}"
            raise ValueError(msg)
        return CheckpointSavedData.model_validate(fields)
    return None


class TimingBatch:
    """A rank's step timings, gathered into one heartbeat at most every `TIMINGS_EVERY_S` seconds."""

    def __init__(self, now: float) -> None:
        self._timings: list[StepTiming] = []
        self._sent_at = now

    def add(self, progress: HeartbeatData, now: float) -> HeartbeatData | None:
        """The heartbeat to send now, if any: a step without timings at once, timings once they are due."""
        if not progress.timings:
            return progress
        self._timings.extend(progress.timings)
        if now - self._sent_at < TIMINGS_EVERY_S and len(self._timings) < MAX_TIMINGS:
            return None
        self._sent_at = now
        return self.rest()

    def rest(self) -> HeartbeatData | None:
        """What is gathered and not sent yet, as one heartbeat (the rank's output ended), or None."""
        if not self._timings:
            return None
        sent, self._timings = self._timings[:MAX_TIMINGS], self._timings[MAX_TIMINGS:]
        return HeartbeatData(step=sent[-1].step, timings=tuple(sent))


def progress_line(line: str, job_id: str) -> HeartbeatData | CheckpointSavedData | None:
    """The line's progress report, if it is one; a malformed one is the rank's bug: logged, and tailing goes on."""
    try:
        return progress_report(line)
    except ValueError as exc:
        log.warning("rank printed a malformed progress line", job_id=job_id, error=str(exc))
        return None
