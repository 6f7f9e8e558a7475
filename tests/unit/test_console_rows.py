"""The console's pure core: rows from stored events, the first-error election, the filters of a view's URL."""

from __future__ import annotations

from typing import Any

import pytest

from lanes_console.rows import BadQueryError, Filters, FirstError, is_failure, job_update, row_of, summary_of
from lanes_contract.codec import encode
from lanes_contract.events import (
    FindingCause,
    JobFinding,
    JobFindingData,
    JobStateChanged,
    JobStateChangedData,
    Lane,
    RankExited,
    RankExitedData,
)
from lanes_contract.jobs import JobState


def stored(seq: int, event: Any) -> dict[str, Any]:
    """The row of an event as the console reads it back: encoded as it is published, then decoded."""
    encoded = encode(event)
    return row_of(seq, encoded.subject, encoded.headers, encoded.payload)


def exited(rank: int, code: int) -> RankExited:
    return RankExited(
        source="tests", jobid="j-1", attempt=1, node="node-1", rank=rank, data=RankExitedData(exit_code=code)
    )


def finding(version: int, category: str) -> JobFinding:
    cause = FindingCause(category=category, lane=Lane.HOST, node="node-2", rank=1, summary=f"{category} on node-2")
    data = JobFindingData(version=version, first_error=cause, stage="steady_state", confidence=0.9, settled=True)
    return JobFinding(source="lanes/telemetry", jobid="j-1", attempt=1, lane=Lane.HOST, data=data)


def test_a_row_carries_the_join_keys_and_says_what_the_event_means() -> None:
    row = stored(7, exited(1, 137))
    assert (row["seq"], row["kind"], row["lane"], row["node"], row["rank"], row["attempt"]) == (
        7,
        "rank_exited",
        "host",
        "node-1",
        1,
        1,
    )
    assert (row["summary"], row["failure"]) == ("exit 137", True)
    assert stored(8, exited(0, 0))["failure"] is False


def test_an_undecodable_message_keeps_its_place_with_the_reason() -> None:
    row = row_of(3, "lanes.job.j-1.rank_exited", {}, b"not json")
    assert (row["seq"], row["type"], row["lane"]) == (3, None, None)
    assert row["error"]
    assert Filters(failures=True).keeps(row)  # an event nobody can read is worth a look


def test_the_first_finding_replaces_a_failed_exit_and_a_late_older_version_does_not_replace_a_newer() -> None:
    election = FirstError()
    assert not election.add(stored(1, exited(0, 0)))
    assert election.add(stored(2, exited(1, 9)))
    assert election.current is not None
    assert (election.current["seq"], election.current["category"]) == (2, "process_exit")
    assert not election.add(stored(3, exited(2, 9)))  # the first failed exit stays the one
    assert election.add(stored(4, finding(2, "oom_kill")))
    assert (election.current["seq"], election.current["lane"]) == (4, "host")
    assert not election.add(stored(5, finding(1, "xid")))  # version 1 arrived after version 2
    assert election.current["category"] == "oom_kill"
    assert not election.add(stored(6, exited(3, 1)))  # a finding is never replaced by an exit
    assert election.add(stored(7, finding(3, "nccl_timeout")))
    assert election.current["detail"] == "nccl_timeout on node-2"


@pytest.mark.parametrize(
    ("query", "said"),
    [
        ({"failures": "true"}, "failures must be 0 or 1"),
        ({"lane": "host,kitchen"}, "unknown lane 'kitchen'"),
        ({"q": "(a"}, "not a regular expression"),
        ({"q": "x" * 201}, "at most 200"),
    ],
)
def test_a_bad_filter_is_refused_with_what_is_wrong(query: dict[str, str], said: str) -> None:
    with pytest.raises(BadQueryError, match=said):
        Filters.parse(query)


def test_the_filters_keep_failures_lanes_and_text_matches() -> None:
    rows = [stored(1, exited(0, 0)), stored(2, exited(1, 9)), stored(3, finding(1, "oom_kill"))]

    def kept(query: dict[str, str]) -> list[int]:
        filters = Filters.parse(query)
        return [row["seq"] for row in rows if filters.keeps(row)]

    assert kept({}) == [1, 2, 3]
    assert kept({"failures": "1"}) == [2, 3]
    assert kept({"lane": "network"}) == []
    assert kept({"lane": "network,host", "failures": "1"}) == [2, 3]
    assert kept({"q": "OOM_KILL on node-\\d"}) == [3]  # a regex, case-insensitive, over the summary and data
    assert kept({"q": r"\bexit 9\b"}) == [2]


def test_a_summary_is_one_line_without_control_characters_whatever_the_event_says() -> None:
    said = summary_of("evidence", {"evidence": {"category": "oom_kill", "summary": "a\x1b[2J\r\nb\x9b31m\tc"}})
    assert said == "oom_kill: a [2J b 31m c"
    assert len(summary_of("waiting", {"reason": "r", "detail": "x" * 5000})) == 300


def test_the_jobs_list_takes_a_name_a_state_and_the_lane_and_owner_of_the_first_error() -> None:
    changed = JobStateChanged(
        source="lanes/lifecycle",
        jobid="j-1",
        attempt=1,
        data=JobStateChangedData(from_state=JobState.RUNNING, to_state=JobState.FAILED, cause_type="x"),
    )
    assert job_update(stored(4, changed)) | {"time": None} == {
        "seq": 4,
        "job_id": "j-1",
        "time": None,
        "state": "failed",
    }
    update = job_update(stored(5, finding(1, "oom_kill")))
    assert (update["error_lane"], update["job_id"]) == ("host", "j-1")


@pytest.mark.parametrize(
    ("type_", "failure"),
    [
        ("io.lanes.job.rejected.v1", True),
        ("io.lanes.job.transition_rejected.v1", True),
        ("io.lanes.job.recovery_escalated.v1", True),
        ("io.lanes.job.heartbeat.v1", False),
    ],
)
def test_refusals_and_unanswered_waits_count_as_failures_by_their_real_names(type_: str, failure: bool) -> None:
    assert is_failure({"type": type_, "kind": type_.split(".")[3], "data": {}}) is failure
