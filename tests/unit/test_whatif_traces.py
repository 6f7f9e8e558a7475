"""`lanes trace import --format helios | philly`: the Helios and Philly job logs as nodes and submissions.

The samples under tests/data/whatif/ are written by hand in each trace's documented format (Helios:
`cluster_log.csv` and `cluster_gpu_number.csv`; Philly: `cluster_job_log` and `cluster_machine_list`); each
row exercises one rule of the import. The what-if then replays them without double-booking a GPU.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from lanes_cli import trace_cli, whatif_cli
from lanes_cli.traces import (
    ImportedTrace,
    TraceFormatError,
    helios_jobs,
    helios_nodes,
    philly_jobs,
    philly_machines,
)
from lanes_contract.events import AttemptRequested, Event, JobStateChanged, JobSubmitted, NodeRegistered
from lanes_contract.jobs import JobState

DATA = Path(__file__).resolve().parents[1] / "data" / "whatif"
HELIOS_JOBS = DATA / "helios_cluster_log_sample.csv"
HELIOS_VCS = DATA / "helios_cluster_gpu_number_sample.csv"
PHILLY_JOBS = DATA / "philly_cluster_job_log_sample.json"
PHILLY_MACHINES = DATA / "philly_cluster_machine_list_sample.csv"
HELIOS_HEADER = HELIOS_JOBS.read_text().splitlines()[0]
EXIT_BAD_INPUT = 2
runner = CliRunner()


def _app() -> typer.Typer:
    root = typer.Typer()
    trace_cli.register(root)
    whatif_cli.register(root)
    return root


def _helios(*, nodes: bool = True) -> ImportedTrace:
    trace = ImportedTrace()
    pools = helios_nodes(HELIOS_VCS.read_text(), trace) if nodes else None
    helios_jobs(HELIOS_JOBS.read_text(), trace, pools)
    return trace


def _philly() -> ImportedTrace:
    trace = ImportedTrace()
    philly_machines(PHILLY_MACHINES.read_text(), trace)
    philly_jobs(PHILLY_JOBS.read_text(), trace)
    return trace


def _of(trace: ImportedTrace, job: str) -> list[Event]:
    return [e for e in trace.events if e.jobid == job]


def _at(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)


def test_helios_vcs_become_pools_of_8_gpu_nodes_at_their_largest_size() -> None:
    trace = _helios()
    nodes = {e.node: (e.data.pool, e.data.gpus) for e in trace.events if isinstance(e, NodeRegistered)}
    # vcA1b: 16 GPUs -> 2 nodes; vcC2d: 12 then 20 GPUs -> 2 nodes of 8 and one of 4; vcZ9z: none.
    assert nodes == {
        "vcA1b-001": ("vcA1b", 8),
        "vcA1b-002": ("vcA1b", 8),
        "vcC2d-001": ("vcC2d", 8),
        "vcC2d-002": ("vcC2d", 8),
        "vcC2d-003": ("vcC2d", 4),
    }


def test_helios_jobs_are_imported_and_what_the_model_cannot_say_is_counted() -> None:
    trace = _helios()
    assert trace.jobs == 6  # of 8: one without a GPU, one SUSPENDED
    assert dict(trace.unexpressed) == {
        "cpu_requests_ignored": 6,
        "gpus_uneven_across_nodes_rounded_up": 1,
        "jobs_in_state_suspended_skipped": 1,
        "jobs_of_a_vc_without_gpus_in_the_default_pool": 1,
        "jobs_without_gpu": 1,
        "vc_gpus_not_a_multiple_of_8_as_a_smaller_node": 1,
        "vc_size_changes_over_days_taken_at_their_largest": 1,
    }
    assert [e.time for e in trace.events] == sorted(e.time for e in trace.events)


def test_a_helios_job_is_a_gang_of_its_nodes_in_its_vc_with_its_recorded_times() -> None:
    submitted, running, ended = _of(_helios(), "helios-1002")
    assert isinstance(submitted, JobSubmitted)
    spec = submitted.data.spec
    assert (spec.workers, spec.gpus_per_worker, spec.pool, spec.tenant) == (2, 8, "vcA1b", "vcA1b")
    assert submitted.time == _at("2020-06-01 00:10:00")
    assert isinstance(running, JobStateChanged)
    assert (running.data.to_state, running.time) == (JobState.RUNNING, _at("2020-06-01 02:00:00"))
    assert isinstance(ended, JobStateChanged)
    assert (ended.data.to_state, ended.time) == (JobState.FAILED, _at("2020-06-01 03:00:00"))


def test_helios_end_states_and_a_job_cancelled_while_it_queued() -> None:
    trace = _helios()
    ends = {
        e.jobid: e.data.to_state
        for e in trace.events
        if isinstance(e, JobStateChanged) and e.data.to_state is not JobState.RUNNING
    }
    assert ends == {
        "helios-1001": JobState.SUCCEEDED,
        "helios-1002": JobState.FAILED,
        "helios-1004": JobState.CANCELLED,
        "helios-1005": JobState.SUCCEEDED,
        "helios-1006": JobState.FAILED,  # NODE_FAIL
        "helios-1007": JobState.SUCCEEDED,
    }
    assert [type(e).__name__ for e in _of(trace, "helios-1004")] == ["JobSubmitted", "JobStateChanged"]
    (uneven,) = [e for e in _of(trace, "helios-1006") if isinstance(e, JobSubmitted)]
    assert (uneven.data.spec.workers, uneven.data.spec.gpus_per_worker) == (2, 2)  # 3 GPUs on 2 nodes


def test_helios_without_its_vc_file_puts_every_job_in_the_default_pool_and_says_so() -> None:
    trace = _helios(nodes=False)
    assert trace.nodes == 0
    assert trace.unexpressed["vc_partitions_not_imported_without_nodes"] == trace.jobs
    assert {e.data.spec.pool for e in trace.events if isinstance(e, JobSubmitted)} == {"default"}


def test_philly_machines_become_nodes_with_their_gpu_memory() -> None:
    trace = _philly()
    nodes = {e.node: (e.data.gpus, e.data.gpu_memory_gib) for e in trace.events if isinstance(e, NodeRegistered)}
    assert nodes == {"m11": (8, 24), "m12": (8, 24), "m21": (2, 12), "m22": (2, 12)}


def test_philly_jobs_are_imported_and_what_the_model_cannot_say_is_counted() -> None:
    trace = _philly()
    assert trace.jobs == 6  # of 7: one never scheduled
    assert dict(trace.unexpressed) == {
        "attempts_without_times_skipped": 1,
        "jobs_never_scheduled_skipped": 1,
        "jobs_still_running_at_the_snapshot": 1,
        "uneven_gpus_across_machines_rounded_up": 1,
    }


def test_a_philly_job_with_two_attempts_retries_when_the_first_ends() -> None:
    events = _of(_philly(), "philly-1506638472019_00002")
    assert [(type(e).__name__, e.attempt) for e in events] == [
        ("JobSubmitted", 1),
        ("JobStateChanged", 1),
        ("JobStateChanged", 1),
        ("AttemptRequested", 2),
        ("JobStateChanged", 2),
        ("JobStateChanged", 2),
    ]
    first_end, request = events[2], events[3]
    assert isinstance(first_end, JobStateChanged)
    assert (first_end.data.to_state, first_end.time) == (JobState.FAILED, _at("2017-10-07 01:20:00"))
    assert isinstance(request, AttemptRequested)
    assert request.time == first_end.time  # the log has no request time: asked for when the attempt ended
    last = events[-1]
    assert isinstance(last, JobStateChanged)
    assert (last.data.to_state, last.time) == (JobState.FAILED, _at("2017-10-07 04:00:00"))


def test_a_philly_job_on_two_machines_is_a_gang_of_two() -> None:
    (submitted,) = [e for e in _of(_philly(), "philly-1506638472019_00004") if isinstance(e, JobSubmitted)]
    assert (submitted.data.spec.workers, submitted.data.spec.gpus_per_worker) == (2, 2)
    assert submitted.data.spec.tenant == "ff22bb"


def test_importing_twice_writes_the_same_events() -> None:
    for imported in (_helios, _philly):
        first, second = imported(), imported()
        assert [e.id for e in first.events] == [e.id for e in second.events]
        assert len({e.id for e in first.events}) == len(first.events)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("job_id,user\n1,u", "line 1: the Helios cluster_log header lacks"),
        (f"{HELIOS_HEADER}\n1,u,vc,1,1,1,COMPLETED,yesterday,,,0,0", "line 2: submit_time is 'yesterday'"),
        (f"{HELIOS_HEADER}\n1,u,vc,x,1,1,COMPLETED,2020-06-01 00:00:00,,,0,0", "line 2: gpu_num is 'x'"),
        (f"{HELIOS_HEADER}\n1,u,vc,1,1,1", "line 2: expected 12 fields"),
    ],
)
def test_a_malformed_helios_log_names_the_line(text: str, expected: str) -> None:
    with pytest.raises(TraceFormatError, match=expected):
        helios_jobs(text, ImportedTrace())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{", "line 1: not JSON"),
        ('{"jobs": []}', "expected a JSON list of jobs"),
        ('[{"status": "Pass"}]', "job 1: lacks vc, jobid, attempts, submitted_time"),
        (
            '[{"status": "Done", "vc": "v", "jobid": "j", "attempts": [], "submitted_time": "2017-10-07 01:00:00"}]',
            "status is 'Done'; expected Pass, Killed or Failed",
        ),
    ],
)
def test_a_malformed_philly_log_names_the_job(text: str, expected: str) -> None:
    with pytest.raises(TraceFormatError, match=expected):
        philly_jobs(text, ImportedTrace())


@pytest.mark.parametrize(
    ("fmt", "jobs", "nodes"),
    [("helios", HELIOS_JOBS, HELIOS_VCS), ("philly", PHILLY_JOBS, PHILLY_MACHINES)],
)
def test_the_import_then_the_whatif_reports_deltas_without_double_booking(
    tmp_path: Path, fmt: str, jobs: Path, nodes: Path
) -> None:
    log = tmp_path / f"{fmt}.ndjson"
    imported = runner.invoke(
        _app(), ["trace", "import", str(jobs), "--nodes", str(nodes), "--format", fmt, "--out", str(log), "--json"]
    )
    assert imported.exit_code == 0, imported.output
    report = json.loads(imported.output)
    assert report["unexpressed"] == sum(report["unexpressed_by_kind"].values()) > 0
    fewer = tmp_path / "fewer.yaml"
    first_node = next(json.loads(line) for line in log.read_text().splitlines() if "node.registered" in line)
    fewer.write_text(
        f"nodes:\n  - node_id: {first_node['node']}\n    gpus: {first_node['data']['gpus']}\n"
        f"    gpu_model: unknown\n    pool: {first_node['data']['pool']}\n"
    )
    result = runner.invoke(_app(), ["whatif", "scheduler", "--from", str(log), "--topology", str(fewer), "--json"])
    assert result.exit_code == 0, result.output
    whatif = json.loads(result.output)
    assert whatif["double_booked"] == {"old": 0, "new": 0}
    assert whatif["placed"]["old"] == report["jobs"] + (1 if fmt == "philly" else 0) - (1 if fmt == "helios" else 0)
    # One node left: some job cannot run at all, or waits longer for it.
    fewer_placed = whatif["placed"]["new"] < whatif["placed"]["old"]
    assert fewer_placed or whatif["queue_wait_p99_s"]["new"] > whatif["queue_wait_p99_s"]["old"]
    assert whatif["diff"]


def test_a_bad_trace_file_is_one_line_naming_it_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "cluster_job_log"
    bad.write_text("[1]")
    result = runner.invoke(_app(), ["trace", "import", str(bad), "--format", "philly"])
    assert result.exit_code == EXIT_BAD_INPUT
    assert f"{bad}: job 1: expected an object" in " ".join(result.output.split())
