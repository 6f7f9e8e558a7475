"""The node agent's ledger: records survive a reopen, unfinished ones are settled once, old ones are pruned."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from lanes_agent.ledger import RankLedger, RankRecord, process_start, reclaim, still_running

_SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
INTENT = RankRecord(placement="placed-1", rank=3, job_id="job-a", attempt=2, node="node-1", incarnation="run-1")


def test_a_record_written_is_read_back_by_a_new_ledger_on_the_same_directory(tmp_path: Path) -> None:
    RankLedger(tmp_path).put(dataclasses.replace(INTENT, pid=4242, pid_start=17, evidence=2))
    reopened = RankLedger(tmp_path)
    assert reopened.get("placed-1", 3) == dataclasses.replace(INTENT, pid=4242, pid_start=17, evidence=2)
    assert reopened.get("placed-1", 4) is None
    assert reopened.get("placed-2", 3) is None
    assert list(tmp_path.glob("*.tmp")) == []  # the atomic write leaves nothing behind


def test_only_records_without_an_exit_are_unfinished(tmp_path: Path) -> None:
    ledger = RankLedger(tmp_path)
    ledger.put(INTENT)
    ledger.put(dataclasses.replace(INTENT, rank=4, exit={"exit_code": 0}))
    assert [r.rank for r in ledger.unfinished()] == [3]


def test_prune_forgets_old_finished_records_and_keeps_unfinished_ones(tmp_path: Path) -> None:
    ledger = RankLedger(tmp_path)
    ledger.put(INTENT)
    ledger.put(dataclasses.replace(INTENT, rank=4, exit={"exit_code": 0}))
    ledger.put(dataclasses.replace(INTENT, rank=5, exit={"exit_code": 1}))
    week_ago = time.time() - 8 * 24 * 3600
    for rank in (3, 4):
        os.utime(tmp_path / f"placed-1.r{rank}.json", (week_ago, week_ago))
    assert ledger.prune() == 1
    assert ledger.get("placed-1", 3) is not None  # unfinished: never pruned, whatever its age
    assert ledger.get("placed-1", 4) is None
    assert ledger.get("placed-1", 5) is not None  # recent


def test_a_rank_never_started_is_settled_as_lost_without_a_pid() -> None:
    settled = reclaim(INTENT)
    assert settled.exit is not None
    assert settled.exit["exit_code"] is None
    assert settled.exit["signal"] is None
    assert "while starting this rank" in settled.exit["lost"]
    assert settled.exit["evidence"] == 1  # the agent's own statement of the fault


def test_a_rank_still_running_is_killed_and_a_gone_one_is_reported_with_an_unknown_status() -> None:
    rank = subprocess.Popen(_SLEEPER, start_new_session=True)
    try:
        running = dataclasses.replace(INTENT, pid=rank.pid, pid_start=process_start(rank.pid), evidence=4)
        assert still_running(running)
        settled = reclaim(running)
        assert rank.wait(timeout=5) == -9
        assert "was killed" in settled.exit["lost"]  # type: ignore[index]
        assert settled.exit["evidence"] == 5  # type: ignore[index]
        assert not still_running(running)
        gone = reclaim(running)
        assert "status now unknown" in gone.exit["lost"]  # type: ignore[index]
    finally:
        if rank.returncode is None:
            rank.kill()
            rank.wait()


def test_a_pid_reused_by_another_process_is_not_the_rank() -> None:
    other = subprocess.Popen(_SLEEPER, start_new_session=True)
    try:
        start = process_start(other.pid)
        assert start is not None
        impostor = dataclasses.replace(INTENT, pid=other.pid, pid_start=start - 1)  # the rank started earlier
        assert not still_running(impostor)
        reclaim(impostor)
        assert other.poll() is None  # never killed: it is not the rank
    finally:
        other.kill()
        other.wait()


def test_the_events_sent_and_stored_survive_a_reopen_and_a_record_older_than_them_reads_with_none(
    tmp_path: Path,
) -> None:
    ledger = RankLedger(tmp_path)
    ledger.put(INTENT.sending("started-1").holding("started-1").sending("exited-1").sending("exited-1"))
    record = RankLedger(tmp_path).get("placed-1", 3)
    assert record is not None
    assert (record.sent, record.stored) == (("started-1", "exited-1"), ("started-1",))

    older = {"placement": "placed-1", "rank": 4, "job_id": "job-a", "attempt": 2, "node": "node-1"}
    (tmp_path / "placed-1.r4.json").write_text(json.dumps(older | {"incarnation": "run-0", "pid": 7}))
    assert ledger.get("placed-1", 4) == dataclasses.replace(INTENT, rank=4, incarnation="run-0", pid=7)
