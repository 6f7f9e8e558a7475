"""What a rank's output says beside its evidence: readiness, the endpoint it serves on, steps and checkpoints.

The node agent tails every rank's stdout and stderr; these are the lines it recognises as the rank's own
reports rather than as evidence for telemetry: Lanes' markers, NCCL's `Init COMPLETE`, a server's "running on"
line, and the progress lines whose grammar `lanes run` reads too (`lanes_evidence.progress_lines`).
"""

from __future__ import annotations

import re

import structlog

from lanes_contract.events import CheckpointSavedData, HeartbeatData
from lanes_evidence.progress_lines import progress_report

log = structlog.get_logger(__name__)

LOOPBACK = "127.0.0.1"
"""The address of a simulated node that shares the host's network."""
READY_MARKER = "lanes: communicator ready"
"""A rank prints this line once its collective communicator is initialised; the launcher reports it."""
_LISTENING = re.compile(r"Uvicorn running on (?P<scheme>https?)://(?P<host>[^\s:/]+):(?P<port>\d+)")
"""The line an OpenAI-compatible server (vLLM, the toy replica) prints once it accepts requests."""


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


def progress_line(line: str, job_id: str) -> HeartbeatData | CheckpointSavedData | None:
    """The line's progress report, if it is one; a malformed one is the rank's bug: logged, and tailing goes on."""
    try:
        return progress_report(line)
    except ValueError as exc:
        log.warning("rank printed a malformed progress line", job_id=job_id, error=str(exc))
        return None
