"""`lanes analyze` on raw log files: the JSON keys the issue lists, the human view, exit codes."""

from __future__ import annotations

import json
from datetime import UTC
from pathlib import Path

from typer.testing import CliRunner

from lanes_cli.analyze_cli import context_of
from lanes_cli.cli import app

LOGS = Path(__file__).resolve().parent.parent / "data" / "logs"
runner = CliRunner()


def test_json_finding_on_a_directory_of_per_rank_logs():
    result = runner.invoke(app, ["analyze", str(LOGS / "oom_job"), "--json", "--year", "2026"])
    assert result.exit_code == 0, result.output
    finding = json.loads(result.stdout)
    first = finding["first_error"]
    assert {"rank", "node", "lane", "category", "time", "evidence"} <= set(first)
    assert (first["rank"], first["node"], first["lane"], first["category"]) == (3, "node-2", "host", "oom_kill")
    assert first["time"] == "2026-12-02T10:20:04Z"
    assert any("Killed process 41233" in line for line in first["evidence"])
    assert {"consequences", "stage", "missing_evidence", "confidence"} <= set(finding)
    assert finding["stage"] == "steady_state"
    assert finding["consequences"][0]["summary"] == "6 ranks timed out in ALLREDUCE SeqNum=1580 after 600 s"


def test_human_view_names_lane_rank_consequences_and_owner():
    result = runner.invoke(app, ["analyze", str(LOGS / "oom_job"), "--year", "2026"])
    assert result.exit_code == 0, result.output
    assert "[host] oom_kill node-2, rank 3" in result.stdout
    assert "6 ranks timed out in ALLREDUCE SeqNum=1580 after 600 s" in result.stdout
    assert "host team" in result.stdout


def test_single_files_work_too():
    result = runner.invoke(app, ["analyze", str(LOGS / "formats" / "kernel.log"), "--json", "--year", "2026"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["first_error"]["category"] == "oom_kill"


def test_missing_file_is_bad_input_and_no_evidence_is_a_failure(tmp_path):
    missing = runner.invoke(app, ["analyze", str(tmp_path / "nope.log")])
    assert missing.exit_code == 2
    assert "no such file" in " ".join(missing.stderr.split())  # rich wraps long paths
    (tmp_path / "rank0.log").write_text("just some output\n")
    nothing = runner.invoke(app, ["analyze", str(tmp_path), "--json"])
    assert nothing.exit_code == 1
    assert json.loads(nothing.stdout)["first_error"] is None


def test_file_names_and_directories_give_node_and_rank(tmp_path):
    assert context_of(tmp_path / "node-2" / "rank3.log", tmp_path, 2026, UTC).node == "node-2"
    assert context_of(tmp_path / "node-2" / "rank3.log", tmp_path, 2026, UTC).rank == 3
    assert (
        context_of(tmp_path / "node-7.rank12.log", None, 2026, UTC).node,
        context_of(tmp_path / "node-7.rank12.log", None, 2026, UTC).rank,
    ) == ("node-7", 12)
    assert context_of(tmp_path / "torchrun.log", None, 2026, UTC).node is None
