"""`lanes analyze FILE...`: the parsers and the first-error election, offline, on raw log files.

Files may be one per rank (`rank3.log`, `node-2.rank3.log`), one per node (`node-2.log`, `node-2/kern.log`)
or one combined torchrun log, beside or instead of PyTorch Flight Recorder dumps (one per rank, JSON or pickle,
the rank in the file name: `rank_3.json`, `nccl_trace_rank_3`), which are read together: the rank that never
entered the others' collective, the rank that called something else, and each rank whose dump is missing (pending
evidence, saying what it would settle). In a directory, a sub-directory names the node of the files inside it, and
an empty rank file still counts: that rank was expected and reported nothing (pending evidence). Notes
beside the logs (`*.md`, `*.toml`, e.g. a corpus case's label) are not logs and are skipped.

Timestamps without a year (glog, syslog) take the year of the file's own dated timestamps, else of its
modification time; those without an offset take the file's own offset, else UTC (`--year` / `--utc-offset`
say otherwise).
"""

from __future__ import annotations

import json
import re
import stat
from collections.abc import Iterable, Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from pathlib import Path
from typing import Annotated, Any, BinaryIO

import typer

from lanes_cli.console import EXIT_BAD_INPUT, EXIT_FAILED, fail, out
from lanes_cli.limits import MAX_YEAR, MIN_YEAR, InputLimitError, check_utc_offset
from lanes_cli.terminal import markup, print_line
from lanes_contract.events import EvidenceCategory, JobFindingData
from lanes_contract.ids import is_valid_token
from lanes_evidence.evidence import Evidence
from lanes_evidence.flight_recorder import (
    MAX_DUMP_BYTES,
    FlightRecorderError,
    FrDump,
    analyze_dumps,
    flight_recorder_evidence,
    is_flight_recorder_dump,
    parse_dump,
    rank_of_name,
)
from lanes_evidence.parsers import LogParser, SourceContext, clock_of
from lanes_evidence.ras import is_ras_report, parse_ras, ras_evidence
from lanes_telemetry.views import World, elect_first_error

_RANK_TOKEN = re.compile(r"^rank[_-]?(\d{1,7})$", re.IGNORECASE)
_MAX_LINE_BYTES = 64 * 1024
_MAX_RAW_KEPT = 10_000
_CLOCK_HEAD_BYTES = 1024 * 1024
"""How much of a file's head is read to learn its clock (year, offset); the parser then streams it all."""
_NOT_LOGS = frozenset({".md", ".toml"})


def context_of(path: Path, root: Path | None, year: int | None, tz: tzinfo) -> SourceContext:
    """What a file's place says about it: the node (its directory or name) and the rank (its name)."""
    rank: int | None = None
    node: str | None = None
    for token in path.name.split("."):
        if m := _RANK_TOKEN.match(token):
            rank = int(m[1])
        elif node is None and token.lower().startswith("node") and is_valid_token(token):
            node = token
    if root is not None and path.parent != root and is_valid_token(path.parent.name):
        node = path.parent.name
    origin = str(path.relative_to(root)) if root is not None else path.name
    return SourceContext(origin=origin, node=node, rank=rank, year=year, tz=tz)


def _special_kind(path: Path) -> str | None:
    """What a path that exists but is not a regular file or directory is (a device never ends: refuse it)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    kinds = {
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISFIFO: "a named pipe",
        stat.S_ISSOCK: "a socket",
    }
    return next((kind for test, kind in kinds.items() if test(mode)), None)


def _files(paths: Iterable[Path]) -> list[tuple[Path, Path | None]]:
    found: list[tuple[Path, Path | None]] = []
    for path in paths:
        if path.is_dir():
            found.extend((f, path) for f in sorted(path.rglob("*")) if f.is_file() and f.suffix not in _NOT_LOGS)
        elif path.is_file():
            found.append((path, None))
        elif kind := _special_kind(path):
            fail(f"{path} is {kind}, not a log file", EXIT_BAD_INPUT)
        else:
            fail(f"{path}: no such file or directory", EXIT_BAD_INPUT)
    return found


def _lines(handle: BinaryIO) -> Iterator[str]:
    """The lines of a file, read one at a time with a bounded length: memory stays flat on any input.

    A line longer than `_MAX_LINE_BYTES` keeps its head (the parsers read at most MAX_LINE characters of
    a line anyway); the rest of it is skipped.
    """
    while chunk := handle.readline(_MAX_LINE_BYTES):
        if not chunk.endswith(b"\n"):
            while (rest := handle.readline(_MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                pass
        yield chunk.decode("utf-8", "replace")


def _stream_evidence(path: Path, context: SourceContext, parser: LogParser | None = None) -> Iterator[Evidence]:
    """The evidence of one file, parsed line by line as it is read (by `parser`, to read its numbering after)."""
    parser = parser or LogParser(context)
    try:
        with path.open("rb") as handle:
            for line in _lines(handle):
                yield from parser.feed(line)
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror}", EXIT_BAD_INPUT)
    yield from parser.finish()


def _head(path: Path) -> str:
    """The first bytes of a file, where its clock is learnt."""
    with path.open("rb") as handle:
        return handle.read(_CLOCK_HEAD_BYTES).decode("utf-8", "replace")


def _read_dump(path: Path, context: SourceContext) -> FrDump:
    """One Flight Recorder dump, read whole within its size bound; its rank comes from the file name."""
    rank = context.rank if context.rank is not None else rank_of_name(path.name)
    if rank is None:
        fail(f"{path}: a Flight Recorder dump whose name gives no rank (name it rank_<r>.json)", EXIT_BAD_INPUT)
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_DUMP_BYTES + 1)
        return parse_dump(data, rank=rank, origin=context.origin)
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror}", EXIT_BAD_INPUT)
    except FlightRecorderError as exc:
        fail(str(exc), EXIT_BAD_INPUT)


def _load_dumps(
    files: list[tuple[Path, Path | None]], ranks: dict[int, str | None], nodes: set[str]
) -> dict[int, FrDump]:
    """Every dump by rank; each rank (with its directory's node, as a log's) joins the world."""
    dumps: dict[int, FrDump] = {}
    for path, root in files:
        context = context_of(path, root, None, UTC)
        dump = _read_dump(path, context)
        dumps[dump.rank] = dump
        ranks[dump.rank] = ranks.get(dump.rank) or context.node
        nodes.update(n for n in (context.node,) if n is not None)
    return dumps


def _is_dump(path: Path) -> bool:
    try:
        with path.open("rb") as handle:
            return is_flight_recorder_dump(handle.read(64 * 1024))
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror}", EXIT_BAD_INPUT)


def load_evidence(
    paths: Iterable[Path], *, year: int | None = None, tz: tzinfo | None = None
) -> tuple[list[Evidence], World]:
    """Parse every file; the world is every rank and node the files' names and contents mention.

    `year` / `tz` override what each file's own timestamps (or its modification time) say. Flight Recorder dumps
    are read together: their evidence joins the rest, and a rank their groups' size names joins the world even
    without a dump (the election names its dump as missing).
    """
    evidence: list[Evidence] = []
    ranks: dict[int, str | None] = {}
    nodes: set[str] = set()
    raw_kept = 0
    files = _files(paths)
    dump_paths = {path for path, _ in files if _is_dump(path)}
    dumps = _load_dumps([f for f in files if f[0] in dump_paths], ranks, nodes)
    for path, root in (f for f in files if f[0] not in dump_paths):
        try:
            head = _head(path)
            modified = datetime.fromtimestamp(path.stat().st_mtime, UTC)
        except OSError as exc:
            fail(f"cannot read {path}: {exc.strerror}", EXIT_BAD_INPUT)
        own_year, own_tz = clock_of(head, fallback=modified)
        context = context_of(path, root, year or own_year, tz or own_tz)
        if context.rank is not None:
            ranks[context.rank] = context.node
        if context.node is not None:
            nodes.add(context.node)
        parser = LogParser(context)
        # An `ncclras` report is a whole, not a stream of lines: read from its head (a report for thousands of
        # ranks stays well under the head's size; a longer one is cut there).
        found = ras_evidence(parse_ras(head), context) if is_ras_report(head) else None
        for e in found if found is not None else _stream_evidence(path, context, parser):
            if e.rank is not None:
                ranks.setdefault(e.rank, e.node)
                if ranks[e.rank] is None and e.node is not None:
                    ranks[e.rank] = e.node
            if e.node is not None:
                nodes.add(e.node)
            # Unrecognised lines are never elected: past a bounded sample they only say "this rank and
            # node spoke", which the world above already records, so a huge log keeps memory flat.
            if e.category is EvidenceCategory.RAW:
                raw_kept += 1
                if raw_kept > _MAX_RAW_KEPT:
                    continue
            evidence.append(e)
        # torchrun's rendezvous result lists the ranks it started on this node: a rank there that never
        # wrote a line is still part of the world (and, when a GPU is lost, the likeliest to have had it).
        for launched in parser.ranks.global_ranks:
            if ranks.get(launched) is None:
                ranks[launched] = context.node
    _read_dumps_together(dumps, ranks, evidence)
    return evidence, World(ranks=ranks, nodes=frozenset(nodes))


def _read_dumps_together(dumps: dict[int, FrDump], ranks: dict[int, str | None], evidence: list[Evidence]) -> None:
    """The dumps' evidence (added to `evidence`) and their missing ranks (added to the world).

    Read together, not one by one: a dump alone cannot say who lags, nor whose dump is absent.
    """
    if not dumps:
        return
    analysis = analyze_dumps(dumps)
    context = SourceContext(origin="flight recorder", node=None, rank=None, year=None, tz=UTC)
    evidence.extend(
        replace(e, node=ranks.get(e.rank) if e.rank is not None else None)
        for e in flight_recorder_evidence(analysis, context)
    )
    for missing in analysis.missing:
        ranks.setdefault(missing.rank, None)


def finding_json(finding: JobFindingData) -> dict[str, Any]:
    """The finding as `lanes analyze --json` prints it (the live one is `data` of `lanes.job.<job>.finding`)."""
    body: dict[str, Any] = finding.model_dump(mode="json")
    body.pop("version", None)
    return body


def register(app: typer.Typer) -> None:
    """Add `lanes analyze` to the CLI."""
    app.command()(analyze)


def analyze(
    files: Annotated[list[Path], typer.Argument(help="Log files, or directories of per-rank / per-node logs.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the finding as one JSON object.")] = False,
    year: Annotated[
        int | None,
        typer.Option(
            min=MIN_YEAR,
            max=MAX_YEAR,
            help="Year for timestamps that carry none (default: the file's own, else its mtime's).",
        ),
    ] = None,
    utc_offset: Annotated[
        float | None,
        typer.Option(help="Hours from UTC of timestamps without an offset (default: the file's own, else 0)."),
    ] = None,
) -> None:
    """Elect the first error in raw logs, offline; exit 1 when no first error can be elected."""
    try:
        tz = None if utc_offset is None else timezone(timedelta(hours=check_utc_offset(utc_offset)))
    except InputLimitError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    evidence, world = load_evidence(files, year=year, tz=tz)
    finding = elect_first_error(evidence, world=world)
    if as_json:
        out.print_json(json.dumps(finding_json(finding)))
    else:
        render_finding(finding)
    if finding.first_error is None:
        raise typer.Exit(EXIT_FAILED)


def render_finding(finding: JobFindingData) -> None:
    """The finding for a person: first error, its evidence, the grouped consequences, what is missing.

    Summaries, evidence lines and node names come from the logs read: each is printed through `markup` /
    `print_line`, so a control character or `[red]` in a log line is shown, not acted on.
    """
    first = finding.first_error
    if first is None:
        out.print("[bold]No first error[/bold]: no cause and no consequence in the evidence.")
    else:
        where = ", ".join(p for p in (first.node or "", f"rank {first.rank}" if first.rank is not None else "") if p)
        out.print(
            f"[bold]First error[/bold] {markup(f'[{first.lane.value}] {first.category} {where}')} "
            f"at {first.time.isoformat() if first.time else 'unknown time'} (confidence {finding.confidence:.2f})",
            highlight=False,
            emoji=False,
        )
        print_line(out, f"  {first.summary}")
        for line in first.evidence:
            out.print(f"  [dim]> {markup(line)}[/dim]", highlight=False, soft_wrap=True, emoji=False)
    out.print(f"[bold]Stage[/bold] {markup(finding.stage)}", highlight=False)
    if finding.consequences:
        out.print("[bold]Consequences[/bold]")
        for group in finding.consequences:
            print_line(out, f"  {group.summary}")
    if finding.missing_evidence:
        out.print("[bold]Pending evidence[/bold]")
        for item in finding.missing_evidence:
            print_line(out, f"  [{item.lane.value}] {item.what}")
    out.print(f"[bold]Call next[/bold] {markup(finding.owner)}", highlight=False, emoji=False)
