"""`lanes whatif recovery --policy NEW.yaml --from LOG.ndjson [--json]`: a policy change tried on the recorded past.

The log is what `lanes replay` (or `lanes demo --export`) writes, so a what-if needs no running server.
Recovery's own handlers replay it under the new policy (`lanes_recovery.views.replay_recovery`); this command
reads the two files, refusing a malformed one with one line and exit 2, and prints the decision diff and the
deltas.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lanes_cli.console import EXIT_BAD_INPUT, fail, load_settings, out, run_async
from lanes_cli.import_cli import read_events
from lanes_cli.input_files import read_text_file
from lanes_cli.terminal import print_json, print_line
from lanes_recovery.views import Policy, PolicyError, WhatIf, parse_policy, replay_recovery

app = typer.Typer(help="Replay a recorded log under a changed policy and show what would have changed.")


def register(root: typer.Typer) -> None:
    """Add `lanes whatif` to the `lanes` app."""
    root.add_typer(app, name="whatif")


def load_policy(path: Path) -> Policy:
    """The policy file, validated; a malformed one is one line on stderr and exit 2."""
    text = read_text_file(path, what="a recovery policy is YAML")
    try:
        return parse_policy(text, origin=str(path))
    except PolicyError as exc:
        fail(str(exc), EXIT_BAD_INPUT)


@app.command()
def recovery(
    policy: Annotated[Path, typer.Option("--policy", help="The recovery policy to try (YAML).", dir_okay=False)],
    log: Annotated[
        Path,
        typer.Option("--from", help="NDJSON of the job stream, as `lanes replay` or `lanes demo --export` write it."),
    ],
    as_json: Annotated[bool, typer.Option("--json", help='Print {"diff": [...], "deltas": {...}}.')] = False,
) -> None:
    """Replay the recorded job events through recovery's handlers under POLICY; diff its decisions with the log's."""
    load_settings(quiet=True)  # quiet: the handlers' per-decision logs would drown the diff
    chosen = load_policy(policy)
    events = read_events(log)
    result = run_async(lambda: replay_recovery(events, chosen))
    if as_json:
        print_json(out, result.as_json())
    else:
        render(result)


def render(result: WhatIf) -> None:
    """The diff, one block per changed decision, then the deltas in total and per owner."""
    print_line(
        out,
        f"recovery what-if under {result.policy} v{result.policy_version}: {result.replayed} of {result.events} "
        f"events replayed, {len(result.recorded)} decisions recorded, {len(result.new)} made",
    )
    print_line(out, f"  {result.treatment[0]} ({result.digests_mismatched} refused for their digest in the log)")
    horizon = "no event" if result.horizon is None else result.horizon.isoformat()
    print_line(out, f"  {result.treatment[1]} ({horizon})")
    if not result.diff:
        print_line(out, f"no decision changed ({len(result.new)} decisions replayed)")
    for change in result.diff:
        print_line(out, f"{change.job_id} attempt {change.attempt}:")
        for side, decision in (("recorded", change.recorded), ("new", change.new)):
            if decision is None:
                print_line(out, f"  {side:<9} (none)")
                continue
            cordon = f", cordon {', '.join(decision.cordon)}" if decision.cordon else ""
            print_line(out, f"  {side:<9} {decision.action} -> {decision.owner}{cordon}: {decision.reason}")
    deltas = result.deltas()
    totals = ", ".join(
        f"{what} {deltas[what]['recorded']} -> {deltas[what]['new']}" for what in ("retries", "cordons", "pages")
    )
    print_line(out, f"deltas: {totals}")
    for owner, counts in deltas["by_owner"].items():
        changed = [f"{what} {c['delta']:+d}" for what, c in counts.items() if c["delta"]]
        if changed:
            print_line(out, f"  {owner}: {', '.join(changed)}")
