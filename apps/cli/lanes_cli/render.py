"""Terminal rendering of a job's timeline, grouped by responsibility lane.

Each line carries every join key (seq, time, attempt, node, rank, source, type), so a line copied into a
ticket or grepped out of a log still says everything about its event, and the signer next to the source the
event claims. Whatever an event says is printed through `lanes_cli.terminal`: one event is one line, and no
control character in it reaches the terminal.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from rich.console import Console

from lanes_cli.incident import bundle
from lanes_cli.terminal import markup, print_line
from lanes_cli.timeline import TimelineEntry
from lanes_contract.events import (
    Event,
    Heartbeat,
    JobEvidence,
    JobPlaced,
    JobSlowdown,
    JobStateChanged,
    JobSubmitted,
    JobWaiting,
    Lane,
    ManualActionRequested,
    RankExited,
    RankStarted,
    RecoveryDecided,
    RecoveryEscalated,
    ReplicaListening,
    ReplicaStateChanged,
    RequestServed,
    ResourcesReleased,
)

if TYPE_CHECKING:
    from lanes_cli.demo import DemoRun


def summarize(event: Event) -> str:
    """One line that says what an event means."""
    if isinstance(event, JobStateChanged):
        d = event.data
        return f"{d.from_state or '-'} -> {d.to_state} ({d.reason})"
    if isinstance(event, JobPlaced):
        return " ".join(f"r{a.rank}@{a.node}[{','.join(map(str, a.gpus))}]" for a in event.data.assignments)
    if isinstance(event, JobSubmitted):
        spec = event.data.spec
        return f"{spec.name}: {spec.workers}x{spec.gpus_per_worker} GPUs {spec.gpu_model or ''} ({spec.workload_class})"
    if isinstance(event, JobWaiting):
        return f"{event.data.reason}: {event.data.detail}"
    if isinstance(event, RankStarted):
        return f"pid {event.data.pid}" if event.data.pid else "started"
    if isinstance(event, RankExited):
        ended = event.data
        return f"signal {ended.signal}" if ended.signal else f"exit {ended.exit_code}"
    if isinstance(event, ResourcesReleased):
        return f"{event.data.gpus} GPUs on {', '.join(event.data.nodes) or 'no node'}"
    if isinstance(event, Heartbeat):
        timed = f" ({len(event.data.timings)} step timings)" if event.data.timings else ""
        return f"step {event.data.step}{timed}"
    if isinstance(event, JobSlowdown):
        return f"{event.data.summary}; {event.data.gpu_hours:g} GPU-hours lost so far"
    if isinstance(event, JobEvidence):
        evidence = event.data.evidence
        said = evidence.summary or next(iter(evidence.lines), "")
        more = "; further ones are counted in the finding, not copied" if event.data.last_copy_of_category else ""
        return f"{evidence.category.value}: {said}{more}"
    return _summarize_recovery_or_serving(event) or _raw(event)


def _summarize_recovery_or_serving(event: Event) -> str | None:
    if isinstance(event, RecoveryDecided):
        decided = event.data
        step = f" from step {decided.checkpoint.step}" if decided.checkpoint else ""
        policy = f"{decided.policy} v{decided.policy_version}"
        return f"{decided.action}{step} ({policy}): {decided.reason}; owner {decided.owner}"
    if isinstance(event, RecoveryEscalated):
        return f"{event.data.owner} did not decide by {event.data.deadline:%H:%M:%S}"
    if isinstance(event, ManualActionRequested):
        return f"{event.data.action} by {event.data.requested_by or '?'}: {event.data.reason}"
    if isinstance(event, ReplicaListening):
        return f"listening on {event.data.endpoint}"
    if isinstance(event, ReplicaStateChanged):
        replica = event.data
        moved = f"{replica.previous or '-'} -> {replica.state}"
        return f"{replica.model}@{replica.version} {moved} ({replica.signal}: {replica.reason})"
    if isinstance(event, RequestServed):
        served = event.data
        tries = " > ".join(f"{a.replica}:{a.outcome}" for a in served.attempts)
        return (
            f"{served.request_id} {served.status} {served.http_status} via {tries or '-'} in {served.latency_ms:.1f} ms"
        )
    return None


def _raw(event: Event) -> str:
    text = json.dumps(event.model_dump(mode="json")["data"], separators=(",", ":"))
    return text if len(text) <= 80 else text[:77] + "..."  # noqa: PLR2004 - one terminal line


def render_job(console: Console, job: dict[str, Any], entries: list[TimelineEntry]) -> None:
    """Print a job header, then the events of each lane in stream order."""
    attempts = ", ".join(f"#{a['number']} {a['state']}" for a in job.get("attempts", []))
    console.print(
        f"[bold]job {markup(job['job_id'])}[/bold]  state [bold]{markup(job.get('state') or 'unknown')}[/bold]"
        f"  attempts {markup(attempts or '-')}  events {len(entries)}"
    )
    for lane in Lane:
        rows = [(entry, entry.event) for entry in entries if entry.event is not None and entry.event.lane is lane]
        if not rows:
            continue
        console.print(f"\n[bold cyan]{lane.value} lane[/bold cyan] ({len(rows)} events)")
        for entry, event in rows:
            line = (
                f"  #{entry.seq:<4} {event.time.strftime('%H:%M:%S.%f')[:-3]}"
                f"  {event.type.removeprefix('io.lanes.'):<28}"
                f" job={event.jobid or '-'} attempt={event.attempt or '-'} node={event.node or '-'}"
                f" rank={'-' if event.rank is None else event.rank} source={event.source}"
                f" signer={entry.signature.label}  {summarize(event)}"
            )
            print_line(console, line)
    for entry in entries:
        if entry.event is None:
            console.print(
                f"[red]#{entry.seq} on {markup(entry.subject)} could not be decoded: {markup(entry.error or '')}"
                f" signer={markup(entry.signature.label)}[/red]",
                highlight=False,
                soft_wrap=True,
            )


def render_demo(console: Console, run: DemoRun) -> None:
    """Every job's swimlanes, then the OOM job's finding, the topology wait history and the scorecard."""
    for job in run.jobs:
        render_job(console, job, run.entries[job["job_id"]])
        console.print()
    incident = run.incident()
    error = incident["summary"]["first_error"] or {}
    console.print(f"[bold]finding for {run.oom_job_id}[/bold]")
    print_line(
        console,
        f"  first error: {error.get('detail')} - {error.get('lane')} lane, rank {error.get('rank')}"
        f" on {error.get('node')}; call {incident['summary']['owner']}",
    )
    for line in error.get("evidence") or []:
        print_line(console, f"    {line}")
    finding: dict[str, Any] = next(
        (row["data"] for row in reversed(_rows(run, run.oom_job_id)) if row["type"].endswith(".finding.v1")), {}
    )
    for group in finding.get("consequences", []):
        print_line(console, f"  consequence: {group['summary']} ({group['count']} reports)")
    for lane, items in incident["missing_evidence"].items():
        print_line(console, f"  pending evidence, {lane} lane: {'; '.join(items)}")
    _render_recovery(console, run)
    console.print(f"\n[bold]wait history of {run.topology_job_id}[/bold]")
    topology_job = next(job for job in run.jobs if job["job_id"] == run.topology_job_id)
    for wait in topology_job["scheduling"].get("wait_history", []):
        print_line(console, f"  {wait['reason']} for {wait['seconds']:.3f}s: {wait['detail']}")
    console.print("\n[bold]POC scorecard[/bold]")
    for result in run.scorecard:
        print_line(console, f"  {result.verdict.value:<17} {result.capability}: {result.reason}")
    console.print("\n[bold]how the faults were made[/bold]")
    for what, how in run.paths.described().items():
        print_line(console, f"  {what.replace('_', ' ')}: {how}")


def _render_recovery(console: Console, run: DemoRun) -> None:
    """The decision chains of the resumed and the held job, then what the inference clients saw."""
    for title, job_id in (("recovery of", run.oom_job_id), ("manual path of", run.manual_job_id)):
        job = run.job(job_id)
        attempts = ", ".join(f"#{a['number']} {a['state']}" for a in job.get("attempts", []))
        console.print(
            f"\n[bold]{title} {markup(job_id)}[/bold] (now {markup(job['state'])}; attempts {markup(attempts)})",
            soft_wrap=True,
        )
        for step in bundle(job)["decision_chain"]:
            print_line(console, f"  {step['time'][11:23]}  {step['kind']:<17} {_decision_text(step)}")
    inference = run.inference
    incident = run.replica_incident()
    console.print(f"\n[bold]inference: node {inference.failed_node} failed under load[/bold]")
    print_line(console, f"  clients saw: {', '.join(f'{k} {v}' for k, v in inference.clients.items())}")
    touched = incident.get("requests", {})
    outcomes = ", ".join(f"{k} {v}" for k, v in touched.get("outcomes", {}).items())
    print_line(console, f"  requests that tried {inference.replica_job_ids[0]}: {touched.get('count', 0)} ({outcomes})")
    for step in incident["decision_chain"]:
        print_line(console, f"  {step['time'][11:23]}  {step['kind']:<17} {_decision_text(step)}")
    console.print("\n[bold]decisions against the final settled findings[/bold]")
    for verdict in run.verdicts():
        print_line(console, f"  {'agrees  ' if verdict.agrees else 'WRONG   '}{verdict.explain()}")


def _decision_text(step: dict[str, Any]) -> str:
    """A decision in a few words: the action, what it resumes from, cordons, loses and who owns it."""
    if not step.get("action"):
        return str(step.get("reason") or "")[:100]
    parts = [str(step["action"])]
    if "resume_step" in step:
        parts.append(f"from verified step {step['resume_step']}")
    if step.get("cordon"):
        parts.append(f"cordon {', '.join(step['cordon'])}")
    if lost := step.get("lost_work"):
        parts.append(f"lost {lost['steps']} steps x {lost['gpus']} GPUs")
    if step.get("owner"):
        parts.append(f"owner {step['owner']}" + (f" by {step['deadline'][11:19]}" if step.get("deadline") else ""))
    return "; ".join(parts)


def _rows(run: DemoRun, job_id: str) -> list[dict[str, Any]]:
    return next(job["timeline"] for job in run.jobs if job["job_id"] == job_id)
