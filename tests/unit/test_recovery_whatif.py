"""The recovery what-if: recovery's real handlers replayed over recorded job events under another policy.

Hand-written histories check the replay's rules (a changed policy shows in the diff and the deltas, timers
fire only once replay time passes them, a digest refusal in the log is kept); the committed log of a real
demo run (tests/data/whatif/) checks the issue's done-when and the command line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.recovery_events import (
    POLICY,
    SPEC,
    at,
    changed,
    checkpoint,
    finding,
    heartbeat,
    placed,
    released,
    submitted,
)
from typer.testing import CliRunner

from lanes_cli.cli import app
from lanes_contract.codec import decode_structured
from lanes_contract.events import Event, JobStateChanged, Lane, RecoveryAction, RecoveryDecided, RefusedCheckpoint
from lanes_contract.jobs import JobState
from lanes_recovery.adapters.memory import DecisionClashError, MemoryRecoveryStore
from lanes_recovery.domain.knowledge import JobKnowledge
from lanes_recovery.views import Policy, policy_from_file, replay_recovery

DATA = Path(__file__).resolve().parents[1] / "data" / "whatif"
DEMO_LOG = DATA / "demo.ndjson"
RETRY_ALGORITHM = DATA / "retry-algorithm.yaml"
SHIPPED = Path(__file__).resolve().parents[2] / "services/recovery/lanes_recovery/policies/default.yaml"
EXIT_BAD_INPUT = 2
runner = CliRunner()


def _algorithm_failure() -> list[Event]:
    """A training job whose rank raised an exception: the shipped policy leaves it to its owner (ada)."""
    return [
        submitted(),
        placed(),
        finding(Lane.ALGORITHM, "python_exception", node="node-1"),
        changed(JobState.FAILED),
        released(),
    ]


async def _recorded(events: list[Event], policy: Policy = POLICY) -> list[Event]:
    """The history with the decisions recovery makes over it, as a log records them (each after its cause)."""
    result = await replay_recovery(events, policy)
    return [*events, *result.new]


def _demo_log() -> list[Event]:
    return [decode_structured(line) for line in DEMO_LOG.read_bytes().splitlines() if line.strip()]


async def test_a_log_replayed_under_the_policy_that_made_it_has_no_difference() -> None:
    log = await _recorded(_algorithm_failure())
    result = await replay_recovery(log, POLICY)
    assert result.diff == ()
    assert [d.data.action for d in result.recorded] == [RecoveryAction.MANUAL]
    assert [d.id for d in result.new] == [d.id for d in result.recorded]  # ids derive from the cause, not the policy
    deltas = result.deltas()
    assert deltas["pages"] == {"recorded": 1, "new": 1, "delta": 0}


async def test_a_policy_that_retries_algorithm_errors_turns_the_owners_page_into_a_retry() -> None:
    log = await _recorded(_algorithm_failure())
    result = await replay_recovery(log, policy_from_file(RETRY_ALGORITHM))
    (change,) = result.diff
    assert (change.job_id, change.attempt) == ("job-1", 1)
    assert change.recorded is not None
    assert change.new is not None
    assert (change.recorded.action, change.new.action) == ("manual", "resume")
    assert change.reason == change.new.reason
    assert "resume attempt 2" in change.new.reason
    owner = SPEC.owners.algorithm
    assert owner is not None
    assert result.deltas()["by_owner"][owner] == {
        "retries": {"recorded": 0, "new": 1, "delta": 1},
        "cordons": {"recorded": 0, "new": 0, "delta": 0},
        "pages": {"recorded": 1, "new": 0, "delta": -1},
    }
    as_json = result.as_json()
    assert set(as_json["diff"][0]) == {"job_id", "attempt", "recorded", "new", "reason"}


async def test_a_recorded_decision_the_new_policy_does_not_make_is_in_the_diff_with_no_new_decision() -> None:
    log = await _recorded(_algorithm_failure())
    without_failure = [e for e in log if not isinstance(e, JobStateChanged)]  # the attempt never failed
    result = await replay_recovery(without_failure, POLICY)
    (change,) = result.diff
    assert change.recorded is not None
    assert change.new is None


async def test_the_grace_timer_fires_only_once_replay_time_passes_its_due_time() -> None:
    # A failure without any finding: recovery waits finding_grace_s (60 s) after the failure, then decides.
    failure = [submitted(), placed(), changed(JobState.FAILED, seconds=30), released(seconds=31)]
    grace = POLICY.defaults.finding_grace_s
    before_due = await replay_recovery([*failure, heartbeat(5, seconds=30 + grace - 1)], POLICY)
    assert before_due.new == ()  # the log ends before the grace runs out: no timer fired
    later = heartbeat(6, seconds=30 + grace + 100)
    after_due = await replay_recovery([*failure, later], POLICY)
    (decision,) = after_due.new
    assert decision.time == at(30 + grace)  # at the timer's due time, not at the event that passed it
    assert decision.data.settled is False


async def test_a_checkpoint_the_log_shows_refused_for_its_digest_stays_refused() -> None:
    history = [
        submitted(),
        placed(),
        checkpoint(100, seconds=5),
        checkpoint(200, seconds=6),
        finding(Lane.HOST, "oom_kill", node="node-2"),
        changed(JobState.FAILED),
        released(),
    ]
    (made,) = (await replay_recovery(history, POLICY)).new
    assert made.data.checkpoint is not None
    assert made.data.checkpoint.step == 200  # every digest taken as matching: the newest checkpoint
    refused = RefusedCheckpoint(checkpoint=made.data.checkpoint, field="digest", expected="x", found="sha256:bad")
    recorded = made.model_copy(update={"data": made.data.model_copy(update={"refused": (refused,)})})
    result = await replay_recovery([*history, recorded], POLICY)
    (decision,) = result.new
    assert result.digests_mismatched == 1
    assert decision.data.checkpoint is not None
    assert decision.data.checkpoint.step == 100
    assert [(r.checkpoint.step, r.field, r.found) for r in decision.data.refused] == [(200, "digest", "sha256:bad")]


async def test_the_demos_recorded_log_reproduces_every_decision_under_the_shipped_policy() -> None:
    result = await replay_recovery(_demo_log(), policy_from_file(SHIPPED))
    assert result.diff == ()
    assert len(result.recorded) == len(result.new) == 3
    actions = sorted(d.data.action.value for d in result.new)
    assert actions == ["manual", "replace_replica", "resume"]


async def test_the_demos_log_under_a_policy_that_retries_algorithm_errors_names_the_job_left_to_its_owner() -> None:
    log = _demo_log()
    manual = [e for e in log if isinstance(e, RecoveryDecided) and e.data.action is RecoveryAction.MANUAL]
    (owner_job,) = manual
    result = await replay_recovery(log, policy_from_file(RETRY_ALGORITHM))
    (change,) = result.diff
    assert change.job_id == owner_job.job_key
    assert change.job_id.startswith("demo-fail-")
    assert change.recorded is not None
    assert change.new is not None
    assert (change.recorded.action, change.new.action) == ("manual", "resume")
    assert result.deltas()["by_owner"][owner_job.data.owner]["pages"]["delta"] == -1


def test_the_command_says_no_decision_changed_over_the_demo_log() -> None:
    result = runner.invoke(app, ["whatif", "recovery", "--policy", str(SHIPPED), "--from", str(DEMO_LOG)])
    assert result.exit_code == 0, result.output
    assert "no decision changed (3 decisions replayed)" in result.stdout
    assert "checkpoint digests are not recomputed" in result.stdout


def test_the_command_prints_the_diff_as_json() -> None:
    args = ["whatif", "recovery", "--policy", str(RETRY_ALGORITHM), "--from", str(DEMO_LOG), "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    (change,) = printed["diff"]
    assert change["job_id"].startswith("demo-fail-")
    assert (change["recorded"]["action"], change["new"]["action"]) == ("manual", "resume")
    assert printed["deltas"]["retries"] == {"recorded": 2, "new": 3, "delta": 1}


def test_a_malformed_policy_is_one_line_and_exit_2(tmp_path: Path) -> None:
    policy = tmp_path / "bad.yaml"
    policy.write_text("name: broken\nversion: zero\n")
    result = runner.invoke(app, ["whatif", "recovery", "--policy", str(policy), "--from", str(DEMO_LOG)])
    assert result.exit_code == EXIT_BAD_INPUT
    message = result.stderr.strip()
    assert message.startswith("error:")
    assert str(policy) in " ".join(message.split())
    assert "Traceback" not in result.output


def test_a_malformed_log_line_is_one_line_naming_it_and_exit_2(tmp_path: Path) -> None:
    log = tmp_path / "log.ndjson"
    first = DEMO_LOG.read_bytes().splitlines()[0]
    log.write_bytes(first + b"\n{not json\n")
    result = runner.invoke(app, ["whatif", "recovery", "--policy", str(SHIPPED), "--from", str(log)])
    assert result.exit_code == EXIT_BAD_INPUT
    message = " ".join(result.stderr.split())
    assert message.startswith("error:")
    assert f"{log}:2:" in message.replace("\n", "")


async def test_the_result_says_how_digests_and_timers_were_treated() -> None:
    result = await replay_recovery(_demo_log(), policy_from_file(SHIPPED))
    replay = result.as_json()["replay"]
    assert replay["digests"].startswith("checkpoint digests are not recomputed")
    assert "timers fire at their due time, up to the last recorded event" in replay["timers"]
    assert replay["horizon"] == max(e.time for e in _demo_log()).isoformat()
    assert (replay["decisions_recorded"], replay["decisions_replayed"]) == (3, 3)


async def test_the_memory_store_rolls_a_call_back_to_what_it_held_before() -> None:
    # The replay re-runs a call at the recorded decision's time; the first run's writes must leave no trace.
    store = MemoryRecoveryStore()
    kept = (await replay_recovery(await _recorded(_algorithm_failure()), POLICY)).recorded[0]
    await store.record_decision(kept)
    await store.lock_new("job-1")
    before = (dict(store.knowledge), dict(store.due), dict(store.decisions))
    store.begin()
    await store.save(JobKnowledge(job_id="job-1", recheck_at=at(5)), at(5))
    await store.lock_new("job-2")
    await store.mark_superseded(kept.id, "later")
    store.rollback()
    assert (store.knowledge, store.due, store.decisions) == before
    assert store.superseded_by == {}
    with pytest.raises(DecisionClashError):  # the decision is in force again, as before the call
        await store.record_decision(kept.model_copy(update={"id": "another"}))
