"""Taking a rank's Flight Recorder dump from disk once the rank has ended, for the launchers that ran it.

The node agent and `lanes run` both point `TORCH_FR_DUMP_TEMP_FILE` at a prefix and read `<prefix><rank>` after
the rank's output ends; this is the one place that reads it (bounded) and turns it into the rank's evidence.
"""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from lanes_evidence.evidence import Evidence
from lanes_evidence.flight_recorder import MAX_DUMP_BYTES, FlightRecorderError, rank_dump_evidence
from lanes_evidence.parsers import SourceContext


def take_rank_dump(path: Path, context: SourceContext, *, remove: bool) -> tuple[list[Evidence], str | None]:
    """The dump a rank wrote at `path` as its evidence, and why it could not be read (None: read, or none).

    No dump, no evidence and no problem: a rank killed or stopped before it could dump is the one the election
    names as missing its dump. With `remove`, a dump read is deleted (it is on the log now). An unreadable one is
    left where it is, for a person to look at.
    """
    try:
        with path.open("rb") as file:
            written = datetime.fromtimestamp(os.fstat(file.fileno()).st_mtime, UTC)
            data = file.read(MAX_DUMP_BYTES + 1)  # larger is refused as no dump
        found = rank_dump_evidence(data, context)
    except FileNotFoundError:
        return [], None
    except (OSError, FlightRecorderError) as exc:
        return [], f"rank {context.rank}'s Flight Recorder dump {path} cannot be read: {exc}"
    if remove:
        path.unlink(missing_ok=True)
    # Stamped when the dump was written, which is when the rank knew something was wrong; the time it entered
    # its last collective is earlier, often before the fault itself, and would read as evidence of it too soon.
    return [replace(e, time=written) for e in found], None
