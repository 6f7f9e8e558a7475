"""`lanes whatif recovery | scheduler`: a change of policy, cluster or quotas tried on the recorded past.

`lanes whatif recovery --policy NEW.yaml --from LOG.ndjson [--json]`; `lanes whatif scheduler [--topology FILE]
[--quotas FILE] [--policy FILE] --from LOG.ndjson [--json]`.

The log is what `lanes replay` (or `lanes demo --export`) writes, so a what-if needs no running server.
Recovery's own handlers replay it under the new policy (`lanes_recovery.views.replay_recovery`); this command
reads the two files, refusing a malformed one with one line and exit 2, and prints the decision diff and the
deltas. The scheduler's handlers replay the log's node registrations, submissions and ends of attempts
(`lanes_scheduler.views.replay_scheduler`) as recorded and against the changed cluster, quotas or priorities.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from pydantic import BaseModel, ValidationError

from lanes_cli.console import EXIT_BAD_INPUT, fail, load_settings, out, run_async
from lanes_cli.import_cli import read_events
from lanes_cli.input_files import InputFileError, parse_yaml, read_text_file, validation_problems
from lanes_cli.limits import MAX_TOPOLOGY_BYTES
from lanes_cli.terminal import print_json, print_line
from lanes_cli.topology_cli import parse_cluster
from lanes_cli.topology_formats import FORMATS, TopologyFormatError
from lanes_contract.topology import ClusterPolicy
from lanes_recovery.views import Policy, PolicyError, WhatIf, parse_policy, replay_recovery
from lanes_scheduler.views import Changes, PriorityChanges, replay_scheduler

_Model = TypeVar("_Model", bound=BaseModel)

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
    print_line(out, f"  {result.treatment[2]}")
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
    held = deltas["gpu_hours_held_waiting"]
    print_line(out, f"GPU-hours held while waiting: {held['recorded']:.3f} -> {held['new']:.3f}")
    for side in ("recorded", "new"):
        times = deltas["time_to_recover"][side]
        p50 = "-" if times["p50_s"] is None else f"{times['p50_s']:.1f} s"
        longest = "-" if times["max_s"] is None else f"{times['max_s']:.1f} s"
        borrowed = (
            f", {times['placement_delay_borrowed']} with the log's median placement delay"
            if times["placement_delay_borrowed"]
            else ""
        )
        print_line(
            out,
            f"time to recover ({side}): {times['recovered']} recovered, p50 {p50}, max {longest}; "
            f"{times['still_waiting_at_log_end']} still waiting when the log ends{borrowed}",
        )
    refused = deltas["resumes_refused_by_gate"]
    fields = ", ".join(f"{name} {count}" for name, count in refused["fields"]["new"].items())
    print_line(
        out,
        f"resumes the version gate refused: {refused['recorded']} -> {refused['new']}"
        + (f" ({fields})" if fields else ""),
    )


def _document(path: Path, model: type[_Model], what: str) -> _Model:
    """A YAML or JSON file validated as `model`; a malformed one is one line on stderr and exit 2."""
    text = read_text_file(path, what=what)
    try:
        return model.model_validate(parse_yaml(text))
    except InputFileError as exc:
        fail(f"{path}: {exc}", EXIT_BAD_INPUT)
    except ValidationError as exc:
        fail(f"{path}: {validation_problems(exc, model.__name__)}", EXIT_BAD_INPUT)


@app.command()
def scheduler(  # noqa: PLR0917 - typer maps each parameter to an option
    log: Annotated[
        Path,
        typer.Option(
            "--from", help="NDJSON of the node and job streams, as `lanes replay` or `lanes trace import` write it."
        ),
    ],
    topology: Annotated[
        Path | None, typer.Option("--topology", help="The nodes to try instead of the recorded ones.", dir_okay=False)
    ] = None,
    topology_format: Annotated[
        str, typer.Option("--topology-format", help=f"The topology file's format: {', '.join(FORMATS)}.")
    ] = "lanes",
    quotas: Annotated[
        Path | None,
        typer.Option("--quotas", help="Pools and tenant quotas to try (YAML: pools, tenants).", dir_okay=False),
    ] = None,
    policy: Annotated[
        Path | None,
        typer.Option("--policy", help="Priorities to try (YAML: tenants: {name: N}, jobs: {id: N}).", dir_okay=False),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help='Print {"jobs", "placed", ..., "diff": [...]}.')] = False,
) -> None:
    """Replay the recorded submissions, cancels and releases through the scheduler, as recorded and changed."""
    load_settings(quiet=True)
    nodes = None
    if topology is not None:
        if topology_format not in FORMATS:
            fail(f"unknown --topology-format {topology_format!r}; choose one of {', '.join(FORMATS)}", EXIT_BAD_INPUT)
        text = read_text_file(topology, max_bytes=MAX_TOPOLOGY_BYTES, what=f"a topology is text ({topology_format})")
        try:
            nodes = parse_cluster(text, topology_format).nodes
        except TopologyFormatError as exc:
            fail(f"{topology}: {exc}", EXIT_BAD_INPUT)
    chosen_quotas = None if quotas is None else _document(quotas, ClusterPolicy, "quotas are YAML or JSON")
    priorities = None if policy is None else _document(policy, PriorityChanges, "priorities are YAML or JSON")
    changes = None
    if (nodes, chosen_quotas, priorities) != (None, None, None):
        changes = Changes(nodes=nodes, policy=chosen_quotas, priorities=priorities)
    events = read_events(log)
    result = run_async(lambda: replay_scheduler(events, changes))
    if as_json:
        print_json(out, result.as_json())
    else:
        render_scheduler(result.as_json())


def render_scheduler(result: dict[str, Any]) -> None:
    """The replay check, each changed job (placement and wait, old and new, with reasons), then the deltas."""
    check = result["replay_check"]
    print_line(
        out,
        f"scheduler what-if: {result['jobs']} job attempts, {result['replay']['events']} events "
        f"({result['unexpressed']} the replay could not express)",
    )
    if check["recorded"]:
        verdict = "all reproduced" if not check["differences"] else f"{len(check['differences'])} NOT reproduced"
        print_line(out, f"replay check: {check['reproduced']} of {check['recorded']} recorded decisions ({verdict})")
        for miss in check["differences"]:
            print_line(
                out,
                f"  {miss['job_id']} attempt {miss['attempt']}: recorded {_brief(miss['recorded'])}, "
                f"replayed {_brief(miss['replayed'])}",
            )
    else:
        print_line(out, "replay check: the log records no scheduler decision to compare with")
    if not result["diff"]:
        print_line(out, "no job placed or waited differently")
    for change in result["diff"]:
        print_line(out, f"{change['job_id']} attempt {change['attempt']}:")
        for side in ("old", "new"):
            print_line(out, f"  {side:<4} {_side(change[side])}")
    for name in ("placed", "utilisation", "queue_wait_p50_s", "queue_wait_p99_s", "fragmentation"):
        value = result[name]
        print_line(out, f"{name}: {value['old']} -> {value['new']} ({value['delta']:+})")
    booked = result["double_booked"]
    print_line(out, f"double_booked: {booked['old']} -> {booked['new']}")
    reasons = result["wait_reasons"]
    for reason in sorted(set(reasons["old"]) | set(reasons["new"])):
        print_line(out, f"waited for {reason}: {reasons['old'].get(reason, 0)} -> {reasons['new'].get(reason, 0)}")


def _brief(decision: dict[str, Any]) -> str:
    placement = decision["placement"]
    where = "not placed" if not placement else ", ".join(f"{p['node']}{p['gpus']}" for p in placement)
    return f"{where}; waited for {', '.join(decision['reasons']) or 'nothing'}"


def _side(side: dict[str, Any] | None) -> str:
    if side is None:
        return "(not in this run)"
    if side["rejected"]:
        return f"rejected: {side['rejected']}"
    placement = side["placement"]
    where = "not placed" if not placement else ", ".join(f"{p['node']}{p['gpus']}" for p in placement)
    reasons = ", ".join(side["reasons"]) or "no wait reason"
    return f"{where} after {side['wait_s']:.0f}s ({reasons})"
