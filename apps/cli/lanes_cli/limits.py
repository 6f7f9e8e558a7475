"""Every bound the `lanes` command puts on what a user hands it, in one place.

Each is checked before any work that grows with the input (reading, parsing, expanding a hostlist or a
rank range, building YAML objects), and the message of a refusal names the bound, so a user who meets one
knows which it is. Pure: no I/O here.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import yaml
from annotated_types import Le

from lanes_contract.errors import LanesError
from lanes_contract.jobs import JobSpec

# --- sizes of the files read whole -------------------------------------------------------------------

MAX_SPEC_BYTES = 1024 * 1024
"""A job spec or drill plan is a page of YAML; anything larger is a mistake (or an attack)."""
MAX_TOPOLOGY_BYTES = 32 * 1024 * 1024
"""A topology file: `kubectl get nodes -o yaml` of a 10,000-node cluster is about 30 MiB."""
MAX_IMPORT_BYTES = 64 * 1024 * 1024
"""An NDJSON file for `lanes import`: 256 maximal events, or a few hundred thousand ordinary ones."""

# --- YAML and JSON structure -------------------------------------------------------------------------

MAX_YAML_DEPTH = 64
"""Nesting of mappings and lists; a spec or an inventory nests a handful of levels."""
MAX_YAML_NODES = 2_000_000
"""Scalars, mappings and lists in one document, counted with every alias expanded."""
MAX_YAML_EXPANSION = 10
"""How many times aliases may repeat what a file writes (a YAML "billion laughs" repeats it billions of times)."""
_SMALL_DOCUMENT_NODES = 1_000
"""Below this many written nodes the expansion bound counts as if this many were written."""

# --- counts and ranges -------------------------------------------------------------------------------

MAX_HOSTS = 65_536
"""Hosts one topology file may name: more than the largest GPU cluster has nodes."""
MAX_HOSTLIST_DIGITS = 9
"""Digits of a number in a hostlist range (`gpu[000000001-000000002]`)."""
MAX_RANKS = cast("int", next(bound.le for bound in JobSpec.model_fields["workers"].metadata if isinstance(bound, Le)))
"""Ranks of a job, as a job spec's `workers` allows (65,536): `lanes run --ranks` and `--world-size` too."""
MAX_ATTEMPT = 10_000
"""An attempt number given on the command line: far above any retry budget (a job spec allows 100 retries)."""
MAX_LOCAL_NODES = 256
"""Simulated nodes `lanes up` runs on this one machine."""
MAX_STREAM_SEQUENCE = 2**64 - 1
"""JetStream sequences are unsigned 64-bit integers."""
MAX_OPTION_SECONDS = 86_400.0
"""A duration or interval given on the command line (a poll, a heartbeat, a drill's timeout): at most a day."""
MIN_YEAR, MAX_YEAR = 1970, 9998
"""Years `lanes analyze --year` accepts: a log older than Unix time or a year Python cannot hold is a typo."""
MAX_UTC_OFFSET_HOURS = 14.0
"""Clocks run from UTC-12 to UTC+14; `--utc-offset` is within 14 hours of UTC."""

# --- what an error line repeats of the input ---------------------------------------------------------

MAX_QUOTED_CHARS = 60
"""How much of a long input a message quotes (a 10,000-character id is not repeated back whole)."""
MAX_PROBLEMS_SHOWN = 5
"""How many of a file's validation problems one error line names before it says how many more there are."""


def excerpt(text: str) -> str:
    """The input quoted for a message: whole if short, else its first MAX_QUOTED_CHARS characters and `...`."""
    return repr(text if len(text) <= MAX_QUOTED_CHARS else text[:MAX_QUOTED_CHARS] + "...")


class InputLimitError(LanesError, ValueError):
    """An input beyond one of the bounds above; the message names the bound."""


def check_utc_offset(hours: float) -> float:
    """An offset in hours a clock can have, or InputLimitError (also for nan and inf)."""
    if not (math.isfinite(hours) and abs(hours) <= MAX_UTC_OFFSET_HOURS):
        msg = f"--utc-offset {hours}: beyond the limit of {MAX_UTC_OFFSET_HOURS:g} hours from UTC"
        raise InputLimitError(msg)
    return hours


@dataclass
class _Open:
    anchor: str | None
    nodes_before: int


def check_yaml_shape(text: str) -> None:
    """Refuse YAML (or JSON) nested deeper than MAX_YAML_DEPTH or whose aliases expand it too far.

    Reads the parser's events only (PyYAML's parser keeps an explicit stack, so any depth is safe to
    read): nothing is composed or constructed until the shape is known to be bounded. Syntax errors are
    left for the loader to report with its line.
    """
    sizes: dict[str, int] = {}
    stack: list[_Open] = []
    written = expanded = 0
    try:
        for event in _events(text):
            if isinstance(event, yaml.AliasEvent):
                expanded += sizes.get(event.anchor or "", 1)
            elif isinstance(event, yaml.ScalarEvent):
                written += 1
                expanded += 1
                if event.anchor:
                    sizes[event.anchor] = 1
            elif isinstance(event, yaml.CollectionStartEvent):
                written += 1
                expanded += 1
                stack.append(_Open(event.anchor, expanded))
                if len(stack) > MAX_YAML_DEPTH:
                    where = f" (line {event.start_mark.line + 1})" if event.start_mark else ""
                    msg = f"nested more than the limit of {MAX_YAML_DEPTH} levels{where}"
                    raise InputLimitError(msg)
            elif isinstance(event, yaml.CollectionEndEvent) and stack:
                opened = stack.pop()
                if opened.anchor:
                    sizes[opened.anchor] = expanded - opened.nodes_before + 1
            allowed = min(MAX_YAML_NODES, MAX_YAML_EXPANSION * max(written, _SMALL_DOCUMENT_NODES))
            if expanded > allowed:
                msg = (
                    f"aliases expand the document past {allowed} nodes (at most {MAX_YAML_EXPANSION} times "
                    f"what is written, and {MAX_YAML_NODES} in all)"
                )
                raise InputLimitError(msg)
    except yaml.YAMLError:
        return


def _events(text: str) -> Iterator[yaml.Event]:
    loader = yaml.SafeLoader(text)
    try:
        while loader.check_event():
            yield loader.get_event()  # type: ignore[no-untyped-call]
    finally:
        loader.dispose()
