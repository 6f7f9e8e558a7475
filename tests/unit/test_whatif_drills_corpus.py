"""The replay check over the drills' recorded log (tests/data/whatif/drills.ndjson).

Recorded by tests/integration/test_whatif_drills_live.py (LANES_RECORD_DRILLS=PATH): a kill drill and an
exception drill on a real 4-rank torch job. Under the shipped policy the replay must reproduce every decision;
a change to recovery that alters one fails here with the diff, and the log is re-recorded only on purpose.
"""

from __future__ import annotations

from pathlib import Path

from lanes_cli.import_cli import read_events
from lanes_contract.events import RecoveryAction
from lanes_recovery.views import default_policy, policy_from_file, replay_recovery

DATA = Path(__file__).resolve().parents[1] / "data" / "whatif"
DRILLS_LOG = DATA / "drills.ndjson"


async def test_the_drills_log_reproduces_every_recorded_decision_under_the_shipped_policy() -> None:
    result = await replay_recovery(read_events(DRILLS_LOG), default_policy())
    assert result.diff == ()
    assert sorted(d.data.action for d in result.recorded) == sorted([RecoveryAction.RESUME, RecoveryAction.MANUAL])
    assert [d.id for d in result.new] == [d.id for d in result.recorded]
    deltas = result.deltas()
    assert deltas["time_to_recover"]["new"] == deltas["time_to_recover"]["recorded"]
    assert deltas["time_to_recover"]["recorded"]["recovered"] == 1  # the killed job ran again; the other waits


async def test_retrying_algorithm_errors_changes_only_the_exception_drill() -> None:
    result = await replay_recovery(read_events(DRILLS_LOG), policy_from_file(DATA / "retry-algorithm.yaml"))
    (change,) = result.diff
    assert change.job_id == "whatif-drill-exception"
    assert change.recorded is not None
    assert change.new is not None
    assert (change.recorded.action, change.new.action) == ("manual", "resume")
