"""The progress lines a training rank prints for Lanes, as the node agent and `lanes run` read them.

`lanes: step N [compute_s=C wait_s=W] [rank=R]` for a step (with its seconds computing and waiting in
collectives, what telemetry reads for slow ranks and degraded links), and `lanes: checkpoint saved step=N
path=P digest=D [versions]` for a checkpoint. The drill workload and the torch timing hook print them; any
script may.
"""

from __future__ import annotations

import re

from lanes_contract.events import CheckpointSavedData, HeartbeatData, StepTiming
from lanes_contract.events.progress import MAX_TIMINGS

_STEP = re.compile(
    r"^lanes: step (?P<step>\d+)(?: compute_s=(?P<compute>\d+(?:\.\d+)?) wait_s=(?P<wait>\d+(?:\.\d+)?))?"
    r"(?: rank=(?P<rank>\d+))?\s*$"
)
TIMINGS_EVERY_S = 1.0
"""A rank's step timings travel in one heartbeat at most this often (a step a millisecond is not an event a
millisecond); what is left is sent when its output ends."""
_CHECKPOINT = re.compile(r"^lanes: checkpoint saved (?P<fields>(?:\w+=\S+\s*)+)$")
_CHECKPOINT_FIELDS = frozenset({"step", "path", "digest", "model_version", "data_version", "config_version", "image"})


def progress_report(line: str) -> HeartbeatData | CheckpointSavedData | None:
    """A rank's progress line: a step (`lanes: step N [compute_s=C wait_s=W] [rank=R]`) or a saved checkpoint.

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


def step_rank(line: str) -> int | None:
    """The rank a step line says it is from (`rank=R`), or None.

    A node agent runs one process per rank and knows whose output it reads; `lanes run` reads one pipe that
    torchrun's workers share, so the timing hook names its rank (`lanes_agent/torch_timing.py`).
    """
    step = _STEP.match(line.strip())
    return int(step["rank"]) if step is not None and step["rank"] is not None else None


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
