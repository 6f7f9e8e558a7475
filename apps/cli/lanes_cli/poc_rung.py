"""What one rung of `lanes poc run` showed, read from its job's timeline rows alone.

Pure functions of `lanes timeline --json` rows (like `lanes poc` and `lanes drill`): the stage times, each
drill judged against the plan's criteria, every lane's evidence completeness, the goodput, the verdict of
every capability, and the diff between a rung that passed and the next one that did not. Nothing here is
timed by the runner: every second is the difference of two events' times.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from statistics import median
from typing import Any

from lanes_cli.drills import DrillReport, drill_reports
from lanes_cli.poc import (
    USER_COMMANDS,
    CapabilityResult,
    Row,
    Verdict,
    communication_observability,
    job_lifecycle,
    recovery,
    topology_awareness,
)
from lanes_cli.poc_plan import Criteria, Rung
from lanes_cli.timeline import row_kind

STAGES = ("placed_s", "ranks_started_s", "comm_init_s", "first_step_s", "checkpoint_s", "completed_s", "released_s")
LANES = ("algorithm", "platform", "host", "network")
CAPABILITIES = (
    "topology",
    "orchestration",
    "communication observability",
    "recovery",
    "goodput",
    "inference protection",
    "audit",
    "responsibility",
)
BADPUT_CAUSES = ("waiting", "startup", "redone", "slow_first_step", "recovery_decision")
_TOPOLOGY_LEVELS = ("nvlink_domain", "leaf", "spine")
_STAGE_EVENTS = {
    "placed_s": "placed",
    "ranks_started_s": "rank_started",
    "comm_init_s": "communicator_ready",
    "first_step_s": "heartbeat",
    "checkpoint_s": "checkpoint_saved",
    "completed_s": "state_changed to succeeded",
    "released_s": "resources_released after completion",
}


def _time(row: Row) -> datetime:
    return datetime.fromisoformat(str(row["time"]))


def _seconds(start: datetime | None, row: Row | None) -> float | None:
    if start is None or row is None:
        return None
    return round((_time(row) - start).total_seconds(), 3)


def _of(rows: list[Row], kind: str, attempt: int | None = None) -> list[Row]:
    return [r for r in rows if row_kind(r) == kind and (attempt is None or r.get("attempt") == attempt)]


def _to_state(row: Row) -> str | None:
    return (row.get("data") or {}).get("to_state") if row_kind(row) == "state_changed" else None


def submitted_at(rows: list[Row]) -> datetime | None:
    """When the job was submitted: the origin every stage time counts from."""
    submitted = _of(rows, "submitted")
    return _time(submitted[0]) if submitted else None


def stage_times(rows: list[Row], ranks: int) -> dict[str, float | None]:
    """Seconds from submission to each stage of the first attempt, and to the job's completion and release.

    A stage that needs every rank (started, communicator initialised) counts once the last rank reported it.
    None where the timeline holds no such event.
    """
    start = submitted_at(rows)

    def every_rank(kind: str) -> Row | None:
        seen: dict[int | None, Row] = {}
        for row in _of(rows, kind, 1):
            seen.setdefault(row.get("rank"), row)
        return max(seen.values(), key=_time) if len(seen) >= ranks else None

    def first(kind: str, attempt: int | None = 1) -> Row | None:
        found = _of(rows, kind, attempt)
        return min(found, key=_time) if found else None

    completed = next((r for r in rows if _to_state(r) == "succeeded"), None)
    released = None
    if completed is not None:
        released = next(
            (r for r in _of(rows, "resources_released") if r.get("attempt") == completed.get("attempt")), None
        )
    return {
        "placed_s": _seconds(start, first("placed")),
        "ranks_started_s": _seconds(start, every_rank("rank_started")),
        "comm_init_s": _seconds(start, every_rank("communicator_ready")),
        "first_step_s": _seconds(start, first("heartbeat")),
        "checkpoint_s": _seconds(start, first("checkpoint_saved", None)),
        "completed_s": _seconds(start, completed),
        "released_s": _seconds(start, released),
    }


def drill_result(report: DrillReport, rows: list[Row], criteria: Criteria) -> dict[str, Any]:
    """One drill as the JSON contract names it, with its verdict against the criteria and what is missing."""
    attempt = report.attempt
    named = report.named or {}
    released = any(r.get("attempt") == attempt for r in _of(rows, "resources_released"))
    stopped = any(_to_state(r) in {"failed", "cancelled"} and r.get("attempt") == attempt for r in rows)
    saved = {(r.get("data") or {}).get("step") for r in _of(rows, "checkpoint_saved", attempt)}
    started = {(r.get("data") or {}).get("step") for r in _of(rows, "checkpoint_started", attempt)}
    partial = sorted(step for step in started - saved if step is not None)
    next_attempt = _of(rows, "attempt_requested", attempt + 1)
    resume_step = (next_attempt[0].get("data") or {}).get("resume_step") if next_attempt else None
    earlier = [r for r in _of(rows, "checkpoint_saved") if int(r.get("attempt") or 1) <= attempt]
    earlier_saved = {(r.get("data") or {}).get("step") for r in earlier}
    verified = resume_step is not None and resume_step in earlier_saved
    decisions = [r for r in _of(rows, "recovery_decided", attempt) if _time(r) >= _time_of_drill(rows, report)]
    decision = (decisions[0].get("data") or {}) if decisions else {}
    missing = []
    if report.detect_s is None:
        missing.append("no evidence after the injection")
    elif report.detect_s > criteria.detect_within_s:
        missing.append(f"detected after {report.detect_s:g} s, beyond {criteria.detect_within_s:g} s")
    if criteria.named_right and report.wrong is not None:
        missing.append(f"the finding named {report.wrong}")
    if report.expected_lane is not None:
        if not decision:
            missing.append("no recovery decision")
        elif not (decision.get("owner") and decision.get("rollback")):
            missing.append("the recovery decision names no owner or no rollback path")
        if not stopped:
            missing.append(f"attempt {attempt} never stopped")
        if criteria.released and not released:
            missing.append(f"attempt {attempt}'s allocation was never released")
        if partial:
            missing.append(f"checkpoints of steps {partial} were started and never saved")
        if criteria.verified_checkpoint and decision.get("action") == "resume" and not verified:
            missing.append(f"attempt {attempt + 1} did not resume from a verified checkpoint")
    return {
        "kind": report.kind.value,
        "rank": report.rank,
        "node": report.node,
        "attempt": attempt,
        "named_rank": named.get("rank"),
        "named_node": named.get("node"),
        "named_lane": named.get("lane"),
        "named_right": report.wrong is None,
        "detect_s": report.detect_s,
        "localise_s": report.localise_s,
        "decide_s": report.decide_s,
        "recover_s": report.recover_s,
        "stopped": stopped,
        "partial_artefacts": partial,
        "resumed_from_verified": verified if decision.get("action") == "resume" else None,
        "released": released,
        "decision": report.decision,
        "owner": decision.get("owner"),
        "rollback": decision.get("rollback"),
        "verdict": (Verdict.PENDING_EVIDENCE if missing else Verdict.PASSED).value,
        "missing": "; ".join(missing),
    }


def _time_of_drill(rows: list[Row], report: DrillReport) -> datetime:
    return next(_time(r) for r in rows if r.get("id") == report.drill_id)


def completeness(rows: list[Row]) -> tuple[dict[str, float], dict[str, str]]:
    """Per lane, the share of its events that join the others (job, attempt, time; node for host and network).

    With what is missing for each lane below 1: the first event that does not join, or that the lane said
    nothing at all.
    """
    fractions: dict[str, float] = {}
    missing: dict[str, str] = {}
    for lane in LANES:
        # A finding still being formed names nobody yet (a silent node among many): it is telemetry's conclusion
        # in progress, not the lane's evidence, so it is not held to the lane's join keys.
        mine = [r for r in rows if r.get("lane") == lane and not _interim_finding(r)]
        if not mine:
            fractions[lane] = 0.0
            missing[lane] = f"no {lane}-lane evidence on the timeline"
            continue
        joined = 0
        for row in mine:
            keys = ("time", "job_id") if row_kind(row) in USER_COMMANDS else ("time", "job_id", "attempt")
            lacks = [key for key in keys if row.get(key) in (None, "")]
            if lane in {"host", "network"} and not row.get("node"):
                lacks.append("node")
            if lacks:
                missing.setdefault(lane, f"{row_kind(row)} {row.get('id')} lacks {', '.join(lacks)}")
            else:
                joined += 1
        fractions[lane] = round(joined / len(mine), 4)
    return fractions, missing


def _interim_finding(row: Row) -> bool:
    return row_kind(row) == "finding" and not (row.get("data") or {}).get("settled")


def goodput(rows: list[Row], gpus: int) -> dict[str, Any]:
    """Effective training time ratio, GPU-seconds of work redone, interruptions and lost time by cause.

    A step's time is its slowest rank's compute plus collective wait (the step ends for all when that rank
    does). A step that a later attempt ran again counts as productive once, in the attempt that kept it.
    """
    start = submitted_at(rows)
    step_time: dict[tuple[int, int], float] = defaultdict(float)
    for row in _of(rows, "heartbeat"):
        for timing in (row.get("data") or {}).get("timings") or ():
            key = (int(row.get("attempt") or 1), int(timing["step"]))
            step_time[key] = max(step_time[key], float(timing["compute_s"]) + float(timing["wait_s"]))
    kept: dict[int, tuple[int, float]] = {}
    for (attempt, step), seconds in sorted(step_time.items()):
        kept[step] = (attempt, seconds)  # a later attempt's run of the step replaces an earlier one's
    redone = [(a, s, t) for (a, s), t in step_time.items() if kept[s][0] != a]
    productive = sum(seconds for _, seconds in kept.values())
    end_row = next((r for r in rows if _to_state(r) == "succeeded"), None)
    wall = _seconds(start, end_row)
    attempts = sorted({int(r.get("attempt") or 1) for r in rows if r.get("attempt")})
    failed = {r.get("attempt") for r in rows if _to_state(r) in {"failed", "partially_failed"}}
    badput = dict.fromkeys(BADPUT_CAUSES, 0.0)
    typical = median(step_time.values()) if step_time else 0.0
    for attempt in attempts:
        began = _of(rows, "submitted") if attempt == 1 else _of(rows, "attempt_requested", attempt)
        placed = _of(rows, "placed", attempt)
        ready = _of(rows, "communicator_ready", attempt)
        if began and placed:
            badput["waiting"] += max(0.0, (_time(placed[0]) - _time(began[0])).total_seconds())
        if placed and ready:
            badput["startup"] += max(0.0, (max(map(_time, ready)) - _time(placed[0])).total_seconds())
        firsts = sorted(step for a, step in step_time if a == attempt)
        if attempt > 1 and firsts:
            badput["slow_first_step"] += max(0.0, step_time[(attempt, firsts[0])] - typical)
        if attempt in failed:
            ended = [r for r in rows if _to_state(r) == "failed" and r.get("attempt") == attempt]
            decided = _of(rows, "recovery_decided", attempt)
            if ended and decided:
                badput["recovery_decision"] += max(0.0, (_time(decided[0]) - _time(ended[0])).total_seconds())
    badput["redone"] = sum(t for _, _, t in redone)
    return {
        "ettr": round(productive / wall, 4) if wall else None,
        "productive_s": round(productive, 3),
        "wall_s": wall,
        "lost_steps": len(redone),
        "lost_gpu_s": round(sum(t for _, _, t in redone) * gpus, 3),
        "interruptions": len(failed),
        "badput_s": {cause: round(seconds, 3) for cause, seconds in badput.items()},
    }


@dataclass
class RungResult:
    """One rung: what was asked, the job that ran it, and every figure read back from its timeline."""

    index: int
    rung: Rung
    job_id: str
    rows: list[Row]
    placed: bool
    unplaced_reason: str = ""
    notes: list[str] = field(default_factory=list)
    """What the runner could not do (a drill it could not inject, a rung out of time), said in the verdicts."""

    @property
    def label(self) -> str:
        """`2x4`: nodes x GPUs per node."""
        return f"{self.rung.nodes}x{self.rung.gpus}"

    def nodes_used(self, attempt: int | None = None) -> list[str]:
        """Every node an attempt (any, when None) of the rung's job was placed on."""
        placements = _of(self.rows, "placed", attempt)
        return sorted({a["node"] for r in placements for a in (r.get("data") or {}).get("assignments", ())})


def _recovery_verdict(result: RungResult, drills: list[dict[str, Any]], jobs: dict[str, list[Row]]) -> CapabilityResult:
    """`lanes poc`'s recovery verdict, unless a drill of the plan is pending or was never injected."""
    pending = [d for d in drills if d["verdict"] != Verdict.PASSED.value]
    if not result.rung.drills:
        return CapabilityResult("recovery", Verdict.NOT_APPLICABLE, "the plan injects no drill at this rung")
    if pending:
        first = pending[0]
        return CapabilityResult("recovery", Verdict.PENDING_EVIDENCE, f"{first['kind']} drill: {first['missing']}")
    if len(drills) < len(result.rung.drills):
        what = f"{len(drills)} of {len(result.rung.drills)} drills were injected"
        return CapabilityResult("recovery", Verdict.PENDING_EVIDENCE, what)
    return dataclasses.replace(recovery(jobs), capability="recovery")


def _goodput_verdict(figures: dict[str, Any], criteria: Criteria) -> CapabilityResult:
    ettr = figures["ettr"]
    if ettr is None:
        return CapabilityResult("goodput", Verdict.PENDING_EVIDENCE, "the job never completed: no wall time to divide")
    if ettr < criteria.min_ettr:
        what = f"ettr {ettr:.2f} below the plan's {criteria.min_ettr:.2f}"
        return CapabilityResult("goodput", Verdict.PENDING_EVIDENCE, what)
    return CapabilityResult("goodput", Verdict.PASSED, f"ettr {ettr:.2f}, {figures['interruptions']} interruptions")


def _responsibility_verdict(rows: list[Row], criteria: Criteria) -> CapabilityResult:
    fractions, lacking = completeness(rows)
    short = [lane for lane, fraction in fractions.items() if fraction < criteria.min_completeness]
    if short:
        what = f"{short[0]} lane: {lacking.get(short[0], 'incomplete')}"
        return CapabilityResult("responsibility", Verdict.PENDING_EVIDENCE, what)
    return CapabilityResult(
        "responsibility", Verdict.PASSED, "every lane's evidence joins by job, attempt, node and time"
    )


def _orchestration_verdict(jobs: dict[str, list[Row]], stages: dict[str, float | None]) -> CapabilityResult:
    lifecycle = job_lifecycle(jobs)
    absent = [name for name in STAGES if stages[name] is None]
    if lifecycle.verdict is Verdict.PASSED and absent:
        names = ", ".join(f"{name} ({_STAGE_EVENTS[name]})" for name in absent)
        return CapabilityResult("orchestration", Verdict.PENDING_EVIDENCE, f"no event for {names}")
    return dataclasses.replace(lifecycle, capability="orchestration")


def judge(result: RungResult, criteria: Criteria) -> dict[str, Any]:
    """The rung as the JSON contract names it, with the verdict of every capability on it."""
    rows = result.rows
    drills = [drill_result(report, rows, criteria) for report in drill_reports(rows)]
    fractions, _ = completeness(rows)
    stages = stage_times(rows, result.rung.nodes)
    figures = goodput(rows, result.rung.nodes * result.rung.gpus)
    jobs = {result.job_id: rows} if rows else {}
    verdicts = [dataclasses.replace(topology_awareness(jobs), capability="topology")]
    if not result.placed:
        why = f"the rung of {result.rung.nodes} nodes was never placed: {result.unplaced_reason}"
        unjudged = ("orchestration", "communication observability", "recovery", "goodput", "responsibility")
        verdicts += [CapabilityResult(name, Verdict.PENDING_EVIDENCE, why) for name in unjudged]
    else:
        observed = communication_observability(jobs)
        verdicts += [
            _orchestration_verdict(jobs, stages),
            dataclasses.replace(observed, capability="communication observability"),
            _recovery_verdict(result, drills, jobs),
            _goodput_verdict(figures, criteria),
            _responsibility_verdict(rows, criteria),
        ]
    why = "a training rung: the inference steps are judged apart"
    verdicts += [CapabilityResult("inference protection", Verdict.NOT_APPLICABLE, why), _audit(rows)]
    if result.notes:  # what the runner could not do is never hidden behind a verdict that passed
        verdicts = [
            CapabilityResult(v.capability, Verdict.PENDING_EVIDENCE, "; ".join(result.notes))
            if v.capability in {"recovery", "orchestration"} and v.verdict is Verdict.PASSED
            else v
            for v in verdicts
        ]
    order = {name: at for at, name in enumerate(CAPABILITIES)}
    return {
        "nodes": result.rung.nodes,
        "gpus": result.rung.gpus,
        "label": result.label,
        "job_id": result.job_id,
        "placed": result.placed,
        "unplaced_reason": result.unplaced_reason or None,
        "ended": max((str(r["time"]) for r in rows if r.get("time")), default=None, key=datetime.fromisoformat),
        "nodes_placed": result.nodes_used(1),
        "nodes_used": result.nodes_used(),
        "stages": stages,
        "drills": drills,
        "completeness": fractions,
        "goodput": {k: figures[k] for k in ("ettr", "lost_gpu_s", "interruptions", "badput_s")}
        | {k: figures[k] for k in ("productive_s", "wall_s", "lost_steps")},
        "verdicts": [
            {
                "capability": v.capability,
                "rung": result.label,
                "verdict": v.verdict.value,
                "missing": v.reason if v.verdict is Verdict.PENDING_EVIDENCE else "",
                "reason": v.reason,
            }
            for v in sorted(verdicts, key=lambda v: order[v.capability])
        ],
    }


def _audit(rows: list[Row]) -> CapabilityResult:
    """Every event signed by an identity the keyring verifies."""
    if not rows:
        return CapabilityResult("audit", Verdict.NOT_APPLICABLE, "no events")
    for row in rows:
        if row.get("signature") != "verified":
            what = f"{row_kind(row)} {row.get('id')} is {row.get('signature') or 'unsigned'}"
            return CapabilityResult("audit", Verdict.PENDING_EVIDENCE, what)
    return CapabilityResult("audit", Verdict.PASSED, f"all {len(rows)} events signed and verified")


def rung_passed(rung: dict[str, Any]) -> bool:
    """A rung passed when none of its capabilities is pending evidence."""
    return all(v["verdict"] != Verdict.PENDING_EVIDENCE.value for v in rung["verdicts"])


def _node_states(node_rows: list[Row], until: str | None) -> dict[str, str]:
    """Each node's state when the rung ended (a later rung's or the inference story's cordons are not its)."""
    states: dict[str, str] = {}
    for row in node_rows:
        if until is not None and row.get("time") and _time(row) > datetime.fromisoformat(until):
            continue
        if row_kind(row) == "registered":
            states.setdefault(str(row.get("node")), "ready")
        elif row_kind(row) == "state_changed":
            states[str(row.get("node"))] = str((row.get("data") or {}).get("state"))
    return dict(sorted(states.items()))


def diffs(rungs: list[dict[str, Any]], node_rows: list[Row], interfaces: dict[str, str]) -> list[dict[str, Any]]:
    """For each rung that failed after the one before it passed: what changed between the two.

    The nodes added, the topology domains the new nodes sit in that the earlier rung did not reach (the
    seed of a scale-only failure), their interfaces, and the state each node was left in.
    """
    domains: dict[str, dict[str, str]] = {}
    for row in node_rows:
        node, data = str(row.get("node")), row.get("data") or {}
        if row_kind(row) == "registered":
            domains[node] = {level: data.get(level) or f"{node} (alone)" for level in _TOPOLOGY_LEVELS}
    found = []
    for before, after in itertools.pairwise(rungs):
        if not rung_passed(before) or rung_passed(after):
            continue
        # The first attempts' placements: a resumed attempt's move off a cordoned node is recovery, not scale.
        added = sorted(set(after["nodes_placed"]) - set(before["nodes_placed"]))
        crossed = {
            level: sorted(
                {domains[n][level] for n in after["nodes_placed"] if n in domains}
                - {domains[n][level] for n in before["nodes_placed"] if n in domains}
            )
            for level in _TOPOLOGY_LEVELS
        }
        failing = [v for v in after["verdicts"] if v["verdict"] == Verdict.PENDING_EVIDENCE.value]
        found.append(
            {
                "from": before["label"],
                "to": after["label"],
                "nodes": [before["nodes"], after["nodes"]],
                "nodes_added": added,
                "placed": after["placed"],
                "unplaced_reason": after["unplaced_reason"],
                "domains_crossed": crossed,
                "interfaces": {node: interfaces.get(node, "") for node in added},
                "resource_states": _node_states(node_rows, after.get("ended")),
                "failed": [{"capability": v["capability"], "missing": v["missing"]} for v in failing],
            }
        )
    return found
