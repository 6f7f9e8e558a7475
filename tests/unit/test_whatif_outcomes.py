"""The recovery what-if's outcome deltas: GPU-hours held while waiting, time to recover, resumes the gate refused.

Each is derived from the recorded log's timestamps (failures, placements, recovery's requests) and the side's
decisions; the expected figures here are read from the histories directly, not from the code under test.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from support.recovery_events import POLICY, at, changed, checkpoint, finding, placed, released, submitted

from lanes_contract.events import Event, Lane
from lanes_contract.jobs import JobState
from lanes_recovery.views import Policy, parse_policy, policy_from_file, replay_recovery

DATA = Path(__file__).resolve().parents[1] / "data" / "whatif"
DEMO_LOG = DATA / "demo.ndjson"
SHIPPED = Path(__file__).resolve().parents[2] / "services/recovery/lanes_recovery/policies/default.yaml"
GPUS = 8  # `placed()` puts two ranks of four GPUs each
HOUR = 3600.0


async def _as_recorded(history: list[Event], policy: Policy = POLICY) -> list[Event]:
    """The history with everything recovery published over it, each at the moment it was published."""
    from lanes_recovery.entrypoints.whatif import _Replay  # noqa: PLC0415 - the replay's clock, for the "recording"

    replay = _Replay(policy, ())
    for event in sorted(history, key=lambda e: e.time):
        await replay.feed(event)
    await replay.fire_timers(max(e.time for e in history))
    published = [e.model_copy(update={"time": when}) for e, when in replay.published]
    return sorted([*history, *published], key=lambda e: e.time)


def _oom_history(*, next_placed_at: float | None) -> list[Event]:
    """A training job OOM-killed at 30 s, released at 31 s; its next attempt placed at `next_placed_at`."""
    events: list[Event] = [
        submitted(),
        placed(),
        finding(Lane.HOST, "oom_kill", node="node-2"),
        changed(JobState.FAILED),
        released(),
    ]
    if next_placed_at is not None:
        events.append(placed(attempt=2, nodes=("node-1", "node-3"), seconds=next_placed_at))
    return events


async def test_time_to_recover_and_gpu_hours_come_from_the_failure_and_the_next_placement() -> None:
    log = await _as_recorded(_oom_history(next_placed_at=40))
    deltas = (await replay_recovery(log, POLICY)).deltas()
    waited = 40 - 30
    assert deltas["time_to_recover"]["recorded"]["p50_s"] == waited
    assert deltas["time_to_recover"]["new"] == deltas["time_to_recover"]["recorded"]
    assert deltas["gpu_hours_held_waiting"] == {
        "recorded": round(GPUS * waited / HOUR, 6),
        "new": round(GPUS * waited / HOUR, 6),
        "delta": 0.0,
    }


async def test_an_attempt_never_placed_again_waits_until_the_log_ends() -> None:
    history = _oom_history(next_placed_at=None)
    log = await _as_recorded(history)
    end = log[-1].time
    deltas = (await replay_recovery(log, POLICY)).deltas()
    recorded = deltas["time_to_recover"]["recorded"]
    assert (recorded["recovered"], recorded["not_recovered"], recorded["still_waiting_at_log_end"]) == (0, 1, 1)
    waited = (end - at(30)).total_seconds()
    assert deltas["gpu_hours_held_waiting"]["recorded"] == round(GPUS * waited / HOUR, 6)


async def test_a_policy_that_pages_instead_of_retrying_holds_the_gpus_until_the_log_ends() -> None:
    log = await _as_recorded(_oom_history(next_placed_at=40))
    log.append(finding(Lane.HOST, "unrelated", node="node-3", version=1).model_copy(update={"time": at(100)}))
    pages_on_oom = parse_policy(
        SHIPPED.read_text().replace("action: resume", "action: manual"),
        origin="page-on-oom",
    )
    deltas = (await replay_recovery(log, pages_on_oom)).deltas()
    assert deltas["time_to_recover"]["new"]["recovered"] == 0
    assert deltas["time_to_recover"]["recorded"]["recovered"] == 1
    held = deltas["gpu_hours_held_waiting"]
    assert held["recorded"] == round(GPUS * (40 - 30) / HOUR, 6)
    assert held["new"] == round(GPUS * (100 - 30) / HOUR, 6)  # the log's last event is at 100 s
    assert held["delta"] > 0


def _gate_history(newest_model_version: str | None) -> list[Event]:
    return [
        submitted(),
        placed(),
        checkpoint(100, seconds=5),
        checkpoint(200, seconds=6, model_version=newest_model_version),
        finding(Lane.HOST, "oom_kill", node="node-2"),
        changed(JobState.FAILED),
        released(),
    ]


async def test_a_resume_the_version_gate_turned_away_from_its_newest_checkpoint_is_counted_with_the_field() -> None:
    log = await _as_recorded(_gate_history("sha256:" + "99" * 32))
    result = await replay_recovery(log, POLICY)
    (decision,) = result.new
    assert decision.data.checkpoint is not None
    assert decision.data.checkpoint.step == 100
    refused = result.deltas()["resumes_refused_by_gate"]
    assert (refused["recorded"], refused["new"], refused["delta"]) == (1, 1, 0)
    assert refused["fields"]["new"] == {"model_version": 1}


async def test_a_policy_that_accepts_unrecorded_versions_refuses_one_resume_fewer() -> None:
    log = await _as_recorded(_gate_history(None))  # the newest checkpoint did not record its model version
    accepting = parse_policy(
        SHIPPED.read_text().replace("unrecorded_versions: refuse", "unrecorded_versions: accept"), origin="accepting"
    )
    result = await replay_recovery(log, accepting)
    refused = result.deltas()["resumes_refused_by_gate"]
    assert (refused["recorded"], refused["new"], refused["delta"]) == (1, 0, -1)
    (change,) = result.diff
    assert "step 200" in change.reason


def _demo_lines() -> list[dict[str, Any]]:
    return [json.loads(line) for line in DEMO_LOG.read_text().splitlines() if line.strip()]


def _moment(line: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(line["time"])


def _demo_expectations() -> tuple[dict[str, float], float]:
    """From the raw demo log: each decided failure's wait (to the next placement, else the log's end), GPU-hours."""
    lines = _demo_lines()
    end = max(_moment(line) for line in lines)
    waits: dict[str, float] = {}
    hours = 0.0
    for decided in (line for line in lines if line["type"].endswith("recovery_decided.v1")):
        job, attempt = decided["jobid"], decided["attempt"]
        failed = next(
            _moment(line)
            for line in lines
            if line["jobid"] == job and line.get("attempt") == attempt and line["data"].get("to_state") == "failed"
        )
        placements = [line for line in lines if line["jobid"] == job and line["type"].endswith("job.placed.v1")]
        gpus = sum(len(a["gpus"]) for a in placements[attempt - 1]["data"]["assignments"])
        later = [_moment(p) for p in placements if p["attempt"] == attempt + 1]
        waits[job] = ((later[0] if later else end) - failed).total_seconds()
        hours += gpus * waits[job] / HOUR
    return waits, hours


async def test_over_the_demo_log_the_shipped_policy_changes_no_outcome() -> None:
    from lanes_cli.import_cli import read_events  # noqa: PLC0415 - the command's own reader

    result = await replay_recovery(read_events(DEMO_LOG), policy_from_file(SHIPPED))
    deltas = result.deltas()
    waits, hours = _demo_expectations()
    recovered = sorted(wait for job, wait in waits.items() if not job.startswith("demo-fail"))
    assert deltas["gpu_hours_held_waiting"]["recorded"] == round(hours, 6)
    assert deltas["gpu_hours_held_waiting"]["delta"] == 0
    recorded = deltas["time_to_recover"]["recorded"]
    assert (recorded["recovered"], recorded["not_recovered"]) == (2, 1)  # the owner of demo-fail never answered
    assert recorded["max_s"] == round(recovered[-1], 3)
    assert deltas["time_to_recover"]["new"] == recorded
    assert deltas["resumes_refused_by_gate"]["delta"] == 0


async def test_over_the_demo_log_retrying_algorithm_errors_recovers_the_job_left_to_its_owner_sooner() -> None:
    from lanes_cli.import_cli import read_events  # noqa: PLC0415 - the command's own reader

    result = await replay_recovery(read_events(DEMO_LOG), policy_from_file(DATA / "retry-algorithm.yaml"))
    deltas = result.deltas()
    new = deltas["time_to_recover"]["new"]
    # demo-fail's next attempt was never recorded: its placement delay is the log's median recorded delay.
    assert (new["recovered"], new["not_recovered"], new["placement_delay_borrowed"]) == (3, 0, 1)
    assert deltas["gpu_hours_held_waiting"]["delta"] < 0
    assert result.as_json()["replay"]["outcomes"].startswith("a failed attempt waits")
