"""`lanes trace import --format openb`: the Alibaba 2023 GPU trace as nodes and submissions, what it cannot say counted.

The sample files under tests/data/traces/ are written by hand in the trace's format (the pod and node list
columns of cluster-trace-gpu-v2023); each row exercises one rule of the import.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from lanes_cli import trace_cli
from lanes_cli.import_cli import read_events
from lanes_cli.traces import ORIGIN, TraceFormatError, import_openb
from lanes_contract.events import JobStateChanged, JobSubmitted, NodeRegistered
from lanes_contract.jobs import JobState

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
PODS = TRACES / "openb_pod_list_sample.csv"
NODES = TRACES / "openb_node_list_sample.csv"
runner = CliRunner()
HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time"


def _app() -> typer.Typer:
    root = typer.Typer()
    trace_cli.register(root)

    @root.callback()
    def _root() -> None:
        """The command group under test."""

    return root


def test_the_sample_imports_its_gpu_nodes_and_whole_gpu_pods_and_counts_the_rest() -> None:
    trace = import_openb(PODS.read_text(), NODES.read_text())

    assert trace.nodes == 4  # the CPU-only machine is counted, not registered
    assert trace.jobs == 8  # of 11 pods: one without a GPU, one with half a GPU, one with 24 GPUs
    assert dict(trace.unexpressed) == {
        "cpu_only_nodes": 1,
        "pods_without_gpu": 1,
        "fractional_gpu_skipped": 1,
        "pods_over_16_gpus": 1,
        "several_gpu_models_taken_as_any": 1,
        "cpu_and_memory_requests_ignored": 8,
    }
    assert trace.report()["unexpressed"] == sum(trace.unexpressed.values())


def test_a_pod_becomes_a_submission_a_start_and_an_end_at_its_trace_times() -> None:
    trace = import_openb(PODS.read_text(), None)
    of_0004 = [e for e in trace.events if e.jobid == "openb-pod-0004"]

    submitted, running, ended = of_0004
    assert isinstance(submitted, JobSubmitted)
    assert submitted.time == ORIGIN.replace(second=30)
    assert (submitted.data.spec.gpus_per_worker, submitted.data.spec.gpu_model, submitted.data.spec.tenant) == (
        8,
        "V100M32",
        "be",
    )
    assert isinstance(running, JobStateChanged)
    assert (running.data.to_state, (running.time - ORIGIN).total_seconds()) == (JobState.RUNNING, 3600)
    assert isinstance(ended, JobStateChanged)
    assert (ended.data.to_state, (ended.time - ORIGIN).total_seconds()) == (JobState.SUCCEEDED, 5430)
    assert [e.time for e in trace.events] == sorted(e.time for e in trace.events)


def test_a_pod_deleted_before_it_was_scheduled_is_cancelled_and_a_failed_one_failed() -> None:
    trace = import_openb(PODS.read_text(), None)
    ends = {
        e.jobid: e.data.to_state
        for e in trace.events
        if isinstance(e, JobStateChanged) and e.data.to_state is not JobState.RUNNING
    }

    assert ends["openb-pod-0010"] is JobState.CANCELLED
    assert ends["openb-pod-0006"] is JobState.FAILED
    assert "openb-pod-0002" not in ends  # still running when the trace ends
    assert "openb-pod-0008" not in ends  # never scheduled, never deleted: it waits


def test_fractional_pods_can_be_rounded_up_to_a_whole_gpu_and_are_counted_so() -> None:
    trace = import_openb(PODS.read_text(), None, fractional="whole")

    assert trace.jobs == 9
    assert trace.unexpressed["fractional_gpu_rounded_up"] == 1
    assert "fractional_gpu_skipped" not in trace.unexpressed


def test_importing_twice_writes_the_same_events() -> None:
    first = import_openb(PODS.read_text(), NODES.read_text())
    second = import_openb(PODS.read_text(), NODES.read_text())

    assert [e.id for e in first.events] == [e.id for e in second.events]
    assert len({e.id for e in first.events}) == len(first.events)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("name,num_gpu\np1,1", "line 1: the openb pod list header lacks"),
        (f"{HEADER}\np1,0,0,two,1000,,LS,Running,0,,", "line 2: num_gpu is 'two'; expected a number"),
        (f"{HEADER}\np1,0,0,1,1000,,LS,Running,-5,,", "line 2: creation_time is '-5'; expected a whole number"),
        (f"{HEADER}\np 1,0,0,1,1000,,LS,Running,0,,", "line 2: name 'p 1' is not a name"),
        (f"{HEADER}\np1,0,0,1,1000,,LS,Running,0,,\np1,0,0,1,1000,,LS,Running,0,,", "line 3: pod p1 appears twice"),
        (f"{HEADER}\np1,0,0", "line 2: expected 11 fields"),
    ],
)
def test_a_malformed_pod_list_names_the_line(text: str, expected: str) -> None:
    with pytest.raises(TraceFormatError, match=expected):
        import_openb(text, None)


def test_the_command_writes_a_log_the_whatif_reads_and_reports_what_it_could_not_express(tmp_path: Path) -> None:
    log = tmp_path / "trace.ndjson"
    args = ["trace", "import", str(PODS), "--nodes", str(NODES), "--format", "openb", "--out", str(log), "--json"]

    result = runner.invoke(_app(), args)

    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert (report["nodes"], report["jobs"], report["unexpressed"]) == (4, 8, 13)
    events = read_events(log)
    assert len(events) == report["events"]
    assert sum(isinstance(e, NodeRegistered) for e in events) == 4


def test_a_bad_node_list_is_one_line_naming_the_file_and_exit_2(tmp_path: Path) -> None:
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,1,1,many,V100\n")

    result = runner.invoke(_app(), ["trace", "import", str(PODS), "--nodes", str(nodes), "--format", "openb"])

    assert result.exit_code == 2
    assert f"{nodes}: line 2: gpu is 'many'" in result.output.replace("\n", "")


def test_an_unknown_format_is_exit_2() -> None:
    result = runner.invoke(_app(), ["trace", "import", str(PODS), "--format", "borg"])

    assert result.exit_code == 2
    assert "unknown format" in result.output
