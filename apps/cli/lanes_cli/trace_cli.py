"""`lanes trace import FILE [--nodes NODES_FILE] --format openb [--out LOG.ndjson]`: a public trace as a log.

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
from lanes_cli.traces import FORMATS, FRACTIONAL, ImportedTrace, TraceFormatError, openb_nodes, openb_pods
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


@app.command("import")
def import_trace(  # noqa: PLR0917 - typer maps each parameter to an option
    pods: Annotated[Path, typer.Argument(help="The trace's job (pod) list, e.g. openb_pod_list_default.csv.")],
    fmt: Annotated[str, typer.Option("--format", help=f"The trace's format: {', '.join(FORMATS)}.")],
    nodes: Annotated[
        Path | None, typer.Option("--nodes", help="The trace's node list, e.g. openb_node_list_gpu_node.csv.")
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
    trace = ImportedTrace()
    if nodes is not None:
        try:
            openb_nodes(_read(nodes, "an openb node list is CSV"), trace)
        except TraceFormatError as exc:
            fail(f"{nodes}: {exc}", EXIT_BAD_INPUT)
    try:
        openb_pods(_read(pods, "an openb pod list is CSV"), trace, fractional=fractional)
    except TraceFormatError as exc:
        fail(f"{pods}: {exc}", EXIT_BAD_INPUT)
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
