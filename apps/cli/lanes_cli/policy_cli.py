"""`lanes policy propose | approve | history`: a recovery policy reaches recovery only with its what-if result.

    lanes policy propose NEW.yaml --from LOG.ndjson [--days N] [--store DIR] [--json]
    lanes policy approve VERSION [--name NAME] --by WHO --reason R [--store DIR]
    lanes policy history [--store DIR] [--from LOG.ndjson] [--json]

The record is a ledger in a directory (`--store`, else LANES_POLICY_DIR, else `.lanes/policies`), not a new
event type: `ledger.ndjson` holds one line per proposal and approval, append-only; each proposal keeps its
policy text beside it (`<name>-v<version>.yaml`) with its SHA-256. Proposing replays the recorded log (what
`lanes replay` or `lanes demo --export` write, so no server is needed) under the candidate: the jobs active in
the last `--days` before the log's last event, each replayed whole, and stores the decision diff and the deltas
with the proposal. Approving needs such a proposal, its text unchanged since, a name and a reason; it writes
`approved.yaml`, the file recovery runs under when LANES_RECOVERY_POLICY names it (read when recovery starts).
Every recovery decision already names the policy and version that made it; `history --from LOG` counts them.

A malformed policy is `FILE: line N: what was expected` and exit 2, and changes nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from pydantic import ValidationError

from lanes_cli.console import EXIT_BAD_INPUT, EXIT_NOT_FOUND, fail, load_settings, out, run_async
from lanes_cli.import_cli import read_events
from lanes_cli.input_files import read_text_file
from lanes_cli.terminal import print_json, print_line
from lanes_contract.events import Event, RecoveryDecided
from lanes_recovery.views import Policy, replay_recovery

STORE_ENV = "LANES_POLICY_DIR"
DEFAULT_STORE = Path(".lanes") / "policies"
LEDGER = "ledger.ndjson"
APPROVED = "approved.yaml"
DEFAULT_DAYS = 7

app = typer.Typer(help="Propose a recovery policy with its what-if result, approve it, list the history.")


def register(root: typer.Typer) -> None:
    """Add `lanes policy` to the `lanes` app."""
    root.add_typer(app, name="policy")


# --- a policy, checked with the line of each problem ------------------------------------------------------


def _line_of(root: yaml.Node | None, loc: Sequence[int | str]) -> int:
    """The 1-based line of the YAML node at `loc` (the deepest node found on the way; line 1 for the root)."""
    node = root
    line = 1 if root is None else root.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            found = next((value for key, value in node.value if getattr(key, "value", None) == str(part)), None)
            if found is None:
                return node.start_mark.line + 1
            # A key's value may start on the next line; the key's own line is where a reader looks.
            key_node = next(key for key, value in node.value if value is found)
            line, node = key_node.start_mark.line + 1, found
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def parse_with_lines(text: str, origin: str) -> Policy:
    """The policy, or a ValueError whose message is `ORIGIN: line N: where: what was expected; ...`."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        msg = f"{origin}: {where}not valid YAML: {problem}"
        raise ValueError(msg) from exc
    try:
        return Policy.model_validate(document)
    except ValidationError as exc:
        problems = []
        for error in exc.errors(include_url=False):
            loc = [part for part in error["loc"] if isinstance(part, int | str)]
            field = ".".join(str(part) for part in loc) or "policy"
            message = str(error["msg"]).removeprefix("Value error, ")
            problems.append(f"line {_line_of(root, loc)}: {field}: {message}")
        msg = f"{origin}: " + "; ".join(problems)
        raise ValueError(msg) from exc


# --- the ledger -------------------------------------------------------------------------------------------


def store_dir(given: Path | None) -> Path:
    """The ledger's directory: `--store`, else LANES_POLICY_DIR, else `.lanes/policies`."""
    if given is not None:
        return given
    named = os.environ.get(STORE_ENV)
    return Path(named) if named else DEFAULT_STORE


def read_ledger(store: Path) -> list[dict[str, Any]]:
    """Every entry, oldest first (an absent ledger is an empty history; a damaged line is refused)."""
    path = store / LEDGER
    if not path.exists():
        return []
    entries = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError as exc:
                fail(f"{path}:{number}: not a ledger entry: {exc.msg}", EXIT_BAD_INPUT)
    return entries


def _append(store: Path, entry: dict[str, Any]) -> None:
    store.mkdir(parents=True, exist_ok=True)
    with (store / LEDGER).open("a", encoding="utf-8") as ledger:
        ledger.write(json.dumps(entry, sort_keys=True) + "\n")
        ledger.flush()
        os.fsync(ledger.fileno())


def _write_atomically(path: Path, text: str) -> None:
    """Write through a temporary file and a rename: a reader sees the old policy or the new, never half."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as written:
            written.write(text)
            written.flush()
            os.fsync(written.fileno())
        Path(temporary).replace(path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            Path(temporary).unlink()
        raise


def _digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def _now() -> str:
    return datetime.now(UTC).isoformat()


# --- the what-if window -----------------------------------------------------------------------------------


def window_events(events: Sequence[Event], days: float) -> tuple[list[Event], dict[str, Any]]:
    """The events of the jobs active in the last `days` before the log's last event, each job replayed whole."""
    if not events:
        return [], {"days": days, "from": None, "until": None, "jobs": 0, "events": 0}
    until = max(e.time for e in events)
    since = until - timedelta(days=days)
    active = {e.job_key for e in events if e.time >= since}
    chosen = [e for e in events if e.job_key in active]
    window = {
        "days": days,
        "from": since.isoformat(),
        "until": until.isoformat(),
        "jobs": len(active),
        "events": len(chosen),
    }
    return chosen, window


# --- commands ---------------------------------------------------------------------------------------------


@app.command()
def propose(
    policy: Annotated[Path, typer.Argument(help="The candidate recovery policy (YAML).", dir_okay=False)],
    log: Annotated[
        Path,
        typer.Option("--from", help="NDJSON of the job stream (`lanes replay`, `lanes demo --export`) to replay."),
    ],
    days: Annotated[
        float, typer.Option("--days", min=0.0, help="Replay the jobs active in the last N days of the log.")
    ] = DEFAULT_DAYS,
    store: Annotated[Path | None, typer.Option("--store", help=f"The ledger's directory (else ${STORE_ENV}).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the proposal entry as JSON.")] = False,
) -> None:
    """Record POLICY as a candidate, with its what-if diff and deltas over the log's last N days."""
    load_settings(quiet=True)
    text = read_text_file(policy, what="a recovery policy is YAML")
    try:
        candidate = parse_with_lines(text, str(policy))
    except ValueError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    directory = store_dir(store)
    entries = read_ledger(directory)
    digest = _digest(text)
    for entry in entries:
        same = (entry["name"], entry["version"]) == (candidate.name, candidate.version)
        if entry["kind"] == "proposed" and same and entry["digest"] != digest:
            fail(
                f"{candidate.name} v{candidate.version} was already proposed with other content; "
                "a version names one text: raise `version`",
                EXIT_BAD_INPUT,
            )
        if entry["kind"] == "approved" and entry["name"] == candidate.name and entry["version"] >= candidate.version:
            fail(
                f"{candidate.name} v{entry['version']} is approved already; propose a version above it",
                EXIT_BAD_INPUT,
            )
    events, window = window_events(read_events(log), days)
    result = run_async(lambda: replay_recovery(events, candidate))
    whatif = result.as_json()
    directory.mkdir(parents=True, exist_ok=True)
    kept = directory / f"{candidate.name}-v{candidate.version}.yaml"
    _write_atomically(kept, text)
    entry = {
        "kind": "proposed",
        "at": _now(),
        "name": candidate.name,
        "version": candidate.version,
        "digest": digest,
        "file": kept.name,
        "window": window | {"log": str(log)},
        "whatif": {"diff": whatif["diff"], "deltas": whatif["deltas"]},
    }
    _append(directory, entry)
    if as_json:
        print_json(out, entry)
        return
    changed = len(whatif["diff"])
    print_line(
        out,
        f"proposed {candidate.name} v{candidate.version} ({digest[:19]}): over {window['jobs']} jobs of the last "
        f"{days:g} days, {changed} decision(s) change",
    )
    for change in whatif["diff"]:
        old = change["recorded"]["action"] if change["recorded"] else "none"
        new = change["new"]["action"] if change["new"] else "none"
        print_line(out, f"  {change['job_id']} attempt {change['attempt']}: {old} -> {new}")
    deltas = whatif["deltas"]
    print_line(
        out,
        "  "
        + ", ".join(f"{what} {deltas[what]['recorded']} -> {deltas[what]['new']}" for what in ("retries", "pages"))
        + f", GPU-hours waiting {deltas['gpu_hours_held_waiting']['recorded']:.3f} -> "
        f"{deltas['gpu_hours_held_waiting']['new']:.3f}",
    )
    print_line(
        out, f"approve with: lanes policy approve {candidate.version} --name {candidate.name} --by WHO --reason R"
    )


@app.command()
def approve(
    version: Annotated[int, typer.Argument(help="The proposed version to approve.", min=1)],
    by: Annotated[str, typer.Option("--by", help="Who approves.")],
    reason: Annotated[str, typer.Option("--reason", help="Why.")],
    name: Annotated[
        str | None, typer.Option("--name", help="The policy's name, when versions of several exist.")
    ] = None,
    store: Annotated[Path | None, typer.Option("--store", help=f"The ledger's directory (else ${STORE_ENV}).")] = None,
) -> None:
    """Make a proposed version the one recovery runs under: it must carry its what-if result, unchanged since."""
    if not by.strip() or not reason.strip():
        fail("--by and --reason must say who approves and why", EXIT_BAD_INPUT)
    directory = store_dir(store)
    entries = read_ledger(directory)
    proposals = [
        e
        for e in entries
        if e["kind"] == "proposed" and e["version"] == version and (name is None or e["name"] == name)
    ]
    if not proposals:
        fail(f"no proposal of version {version}{f' of {name}' if name else ''} in {directory / LEDGER}", EXIT_NOT_FOUND)
    if len({e["name"] for e in proposals}) > 1:
        names = ", ".join(sorted({e["name"] for e in proposals}))
        fail(f"version {version} was proposed for {names}: say which with --name", EXIT_BAD_INPUT)
    proposal = proposals[-1]
    if "whatif" not in proposal or "window" not in proposal:
        fail(f"{proposal['name']} v{version} carries no what-if result; propose it again", EXIT_BAD_INPUT)
    kept = directory / proposal["file"]
    try:
        text = kept.read_text(encoding="utf-8")
    except OSError as exc:
        fail(f"cannot read the proposed text {kept}: {exc.strerror}", EXIT_NOT_FOUND)
    if _digest(text) != proposal["digest"]:
        fail(f"{kept} changed since it was proposed; its what-if no longer describes it: propose it again", 2)
    if any(e["kind"] == "approved" and (e["name"], e["version"]) == (proposal["name"], version) for e in entries):
        fail(f"{proposal['name']} v{version} is approved already", EXIT_BAD_INPUT)
    _write_atomically(directory / APPROVED, text)
    _append(
        directory,
        {
            "kind": "approved",
            "at": _now(),
            "name": proposal["name"],
            "version": version,
            "digest": proposal["digest"],
            "by": by,
            "reason": reason,
            "proposed_at": proposal["at"],
        },
    )
    print_line(out, f"approved {proposal['name']} v{version} by {by}: {reason}")
    print_line(
        out,
        f"recovery runs under it from its next start with LANES_RECOVERY_POLICY={(directory / APPROVED).resolve()}",
    )


def _decisions_by_policy(events: Sequence[Event]) -> list[dict[str, Any]]:
    counts = Counter(
        (e.data.policy, e.data.policy_version, e.data.action.value) for e in events if isinstance(e, RecoveryDecided)
    )
    return [
        {"policy": policy, "version": version, "action": action, "decisions": count}
        for (policy, version, action), count in sorted(counts.items())
    ]


@app.command()
def history(
    store: Annotated[Path | None, typer.Option("--store", help=f"The ledger's directory (else ${STORE_ENV}).")] = None,
    log: Annotated[
        Path | None, typer.Option("--from", help="Also count the log's decisions by the policy version that made them.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help='Print {"ledger": [...], "decisions": [...]}.')] = False,
) -> None:
    """The proposals and approvals, oldest first; with --from, the decisions each policy version made."""
    entries = read_ledger(store_dir(store))
    decisions = _decisions_by_policy(read_events(log)) if log is not None else []
    if as_json:
        print_json(out, {"ledger": entries, "decisions": decisions})
        return
    if not entries:
        print_line(out, "no policy proposed yet")
    for entry in entries:
        head = f"{entry['at']}  {entry['kind']:<8} {entry['name']} v{entry['version']}"
        if entry["kind"] == "proposed":
            window = entry["window"]
            print_line(
                out,
                f"{head}: {len(entry['whatif']['diff'])} decision(s) change over {window['jobs']} jobs "
                f"of the last {window['days']:g} days of {window['log']}",
            )
        else:
            print_line(out, f"{head} by {entry['by']}: {entry['reason']}")
    for row in decisions:
        print_line(out, f"{row['policy']} v{row['version']}: {row['decisions']} {row['action']} decision(s) in the log")
