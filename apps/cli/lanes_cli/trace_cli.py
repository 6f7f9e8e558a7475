"""`lanes trace import FILE [--nodes NODES_FILE] --format openb|helios|philly [--out LOG.ndjson]`: a trace as a log.

The files of each format:
- openb (Alibaba GPU trace 2023): FILE `openb_pod_list_*.csv`, NODES_FILE `openb_node_list_*.csv`;
- helios (SenseTime Helios, SC '21): FILE `cluster_log.csv`, NODES_FILE `cluster_gpu_number.csv` (GPUs per VC);
- philly (Microsoft Philly, ATC '19): FILE `cluster_job_log` (JSON), NODES_FILE `cluster_machine_list`.


The log is NDJSON in the form `lanes replay` prints, so `lanes whatif scheduler --from LOG.ndjson` replays it.
The parsing is `lanes_cli.traces`; this command reads the files (bounded, text only), writes the log and says
what was imported and what the model could not express, per kind.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, BinaryIO

import typer

from lanes_cli.console import EXIT_BAD_INPUT, cannot_write, err, fail, out, output_file
from lanes_cli.input_files import read_text_file
from lanes_cli.limits import MAX_IMPORT_BYTES
from lanes_cli.terminal import print_json, print_line
from lanes_cli.traces import (
    FORMATS,
    FRACTIONAL,
    ImportedTrace,
    TraceFormatError,
    helios_jobs,
    helios_nodes,
    openb_nodes,
    openb_pods,
    philly_jobs,
    philly_machines,
)
from lanes_contract.codec import to_structured

app = typer.Typer(help="Public cluster traces as logs the what-if replays.")


def register(root: typer.Typer) -> None:
    """Add `lanes trace` to the `lanes` app."""
    root.add_typer(app, name="trace")


def _read(path: Path, what: str) -> str:
    return read_text_file(path, max_bytes=MAX_IMPORT_BYTES, what=what)


def write_log(trace: ImportedTrace, handle: BinaryIO) -> None:
    """One structured CloudEvent a line, numbered as a stream would number them."""
    for seq, event in enumerate(trace.events, start=1):
        line = {**to_structured(event), "sequence": str(seq)}
        handle.write(json.dumps(line, separators=(",", ":"), ensure_ascii=False).encode() + b"\n")


def _imported(fmt: str, jobs: Path, nodes: Path | None, fractional: str) -> ImportedTrace:
    """The trace's nodes (when given) then its jobs; a malformed file is one line naming it and exit 2."""
    trace = ImportedTrace()
    path = nodes
    try:
        if fmt == "helios":
            pools = None if nodes is None else helios_nodes(_read(nodes, "a Helios cluster_gpu_number is CSV"), trace)
            path = jobs
            helios_jobs(_read(jobs, "a Helios cluster_log is CSV"), trace, pools)
        elif fmt == "philly":
            if nodes is not None:
                philly_machines(_read(nodes, "a Philly cluster_machine_list is CSV"), trace)
            path = jobs
            philly_jobs(_read(jobs, "a Philly cluster_job_log is JSON"), trace)
        else:
            if nodes is not None:
                openb_nodes(_read(nodes, "an openb node list is CSV"), trace)
            path = jobs
            openb_pods(_read(jobs, "an openb pod list is CSV"), trace, fractional=fractional)
    except TraceFormatError as exc:
        fail(f"{path}: {exc}", EXIT_BAD_INPUT)
    return trace


@app.command("import")
def import_trace(  # noqa: PLR0917 - typer maps each parameter to an option
    pods: Annotated[
        Path,
        typer.Argument(
            help="The trace's job list: openb_pod_list_*.csv, cluster_log.csv (helios), cluster_job_log (philly)."
        ),
    ],
    fmt: Annotated[str, typer.Option("--format", help=f"The trace's format: {', '.join(FORMATS)}.")],
    nodes: Annotated[
        Path | None,
        typer.Option(
            "--nodes", help="openb_node_list_*.csv, cluster_gpu_number.csv (helios) or cluster_machine_list (philly)."
        ),
    ] = None,
    log: Annotated[Path | None, typer.Option("--out", help="Write the log here (default: stdout).")] = None,
    fractional: Annotated[
        str, typer.Option("--fractional", help="Pods asking a fraction of a GPU: skip (counted) or whole (rounded up).")
    ] = "skip",
    as_json: Annotated[bool, typer.Option("--json", help="Print what was imported as JSON.")] = False,
) -> None:
    """Turn a public cluster trace into node registrations and submissions for `lanes whatif scheduler`."""
    if fmt not in FORMATS:
        fail(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}", EXIT_BAD_INPUT)
    if fractional not in FRACTIONAL:
        fail(f"--fractional {fractional!r}: choose one of {', '.join(FRACTIONAL)}", EXIT_BAD_INPUT)
    if log is not None:
        output_file(log, "--out")
    trace = _imported(fmt, pods, nodes, fractional)
    if log is None:
        write_log(trace, sys.stdout.buffer)
        sys.stdout.flush()
    else:
        try:
            with log.open("wb") as handle:
                write_log(trace, handle)
        except OSError as exc:
            cannot_write(log, exc)
    report = trace.report()
    console = out if log is not None else err
    if as_json:
        print_json(console, report)
        return
    print_line(console, f"imported {report['nodes']} nodes and {report['jobs']} jobs ({report['events']} events)")
    if report["unexpressed"]:
        kinds = ", ".join(f"{kind} {count}" for kind, count in report["unexpressed_by_kind"].items())
        print_line(console, f"the model cannot express {report['unexpressed']}: {kinds}")
