"""NCCL RAS (`ncclras`) text reports as evidence: the ranks behind on a mismatch, the ranks RAS cannot reach."""

from __future__ import annotations

import json
from datetime import UTC
from pathlib import Path

from typer.testing import CliRunner

from lanes_cli.analyze_cli import load_evidence
from lanes_cli.cli import app
from lanes_contract.events import EvidenceCategory as C
from lanes_contract.events import Lane
from lanes_evidence.parsers import SourceContext
from lanes_evidence.ras import is_ras_report, parse_ras, parse_ras_text, ras_evidence
from lanes_telemetry.views import elect_first_error

RAS = Path(__file__).resolve().parent.parent / "data" / "ras"
CONTEXT = SourceContext(origin="ras.txt", year=2026, tz=UTC)


def test_the_table_and_the_mismatch_block_are_read():
    report = parse_ras_text((RAS / "mismatch_30_behind.txt").read_text())
    assert report.groups[0] == {"comms": "1", "nodes": "4", "per_comm": "32", "status": "RUNNING", "errors": "MISMATCH"}
    (comm,) = report.communicators.values()
    assert (comm.group, comm.index, comm.hash, comm.kinds) == (0, 0, "7c1e0a55d20b9f31", {"MISMATCH"})
    (op,) = comm.mismatched_ops
    assert op.op == "AllReduce"
    assert [(value, count) for value, count, _ in op.groups] == [(6120, 30), (6121, 2)]
    ahead = op.groups[1][2]
    assert [(r.rank, r.node, r.pid) for r in ahead] == [(4, "10.20.0.11", 51204), (13, "10.20.0.12", 51313)]


def test_a_mismatch_names_the_thirty_ranks_behind_not_the_two_ahead_ras_lists():
    report = parse_ras_text((RAS / "mismatch_30_behind.txt").read_text())
    (comm,) = report.communicators.values()
    behind = report.behind(comm, comm.mismatched_ops[0])
    assert len(behind) == 30
    assert 4 not in behind
    assert 13 not in behind
    assert behind[:5] == [0, 1, 2, 3, 5]


def test_every_rank_becomes_a_count_the_election_reads_as_its_last_enqueued_collective():
    evidence = ras_evidence(parse_ras_text((RAS / "mismatch_30_behind.txt").read_text()), CONTEXT)
    assert len(evidence) == 32
    assert {e.category for e in evidence} == {C.COLLECTIVE_TIMEOUT}
    by_rank = {e.rank: e for e in evidence}
    assert by_rank[4].data.last_enqueued == 6121
    assert by_rank[4].node == "10-20-0-11"  # RAS names the node by address: its token
    assert by_rank[0].data.last_enqueued == 6120
    assert "behind" in by_rank[0].data.summary
    finding = elect_first_error(evidence)
    first = finding.first_error
    assert first is not None
    assert (first.category, first.lane, first.rank) == ("collective_not_enqueued", Lane.ALGORITHM, 0)


def test_a_lone_rank_behind_is_elected_and_the_dead_one_is_pending_evidence():
    report = parse_ras_text((RAS / "one_behind_one_dead.txt").read_text())
    (comm,) = report.communicators.values()
    assert [(r.rank, r.node, r.pid) for r in comm.missing] == [(6, "gpu-b", 7706)]
    assert [(r.pid, r.node) for r in report.dead] == [(7706, "gpu-b")]
    op = comm.mismatched_ops[0]
    assert report.behind(comm, op) == [3]
    members = report.members(comm, op)
    assert 6 not in members  # no data from it: in no group
    assert sorted(members) == [0, 1, 2, 3, 4, 5, 7]
    evidence = ras_evidence(report, CONTEXT)
    unread = [e for e in evidence if e.category is C.RAW]
    assert {(e.rank, e.node) for e in unread} == {(6, "gpu-b"), (None, "gpu-b")}
    first = elect_first_error(evidence).first_error
    assert first is not None
    assert (first.lane, first.rank, first.node) == (Lane.ALGORITHM, 3, "gpu-a")


def test_anything_else_is_not_a_report_and_garbage_never_raises():
    assert not is_ras_report("[rank0]: Traceback (most recent call last):\n")
    assert is_ras_report((RAS / "one_behind_one_dead.txt").read_text())
    odd = (
        "Group     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors\n#9-9 (zz) MISMATCH\n  Rank x -- ?\n"
    )
    report = parse_ras_text(odd + "\x00" * 10 + "  Communicator ranks have different  operation counts\n")
    assert ras_evidence(report, CONTEXT) == []


def test_lanes_analyze_reads_a_report_beside_logs(tmp_path: Path):
    (tmp_path / "ras.txt").write_text((RAS / "one_behind_one_dead.txt").read_text())
    _, world = load_evidence([tmp_path])
    assert world.ranks[3] == "gpu-a"
    assert world.ranks[6] == "gpu-b"  # unreachable, yet part of the world
    result = CliRunner().invoke(app, ["analyze", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    finding = json.loads(result.output)
    assert (finding["first_error"]["rank"], finding["first_error"]["lane"]) == (3, "algorithm")
    assert any(m["node"] == "gpu-b" for m in finding["missing_evidence"])


def test_the_json_report_lists_every_rank_so_the_one_behind_is_read_directly():
    text = (RAS / "one_behind.json").read_text()
    assert is_ras_report(text)
    report = parse_ras(text)
    (comm,) = report.communicators.values()
    assert comm.hash == "5e2f0c17aa903b41"
    assert comm.kinds == {"MISMATCH", "INCOMPLETE"}
    (op,) = comm.mismatched_ops  # AllGather agrees everywhere; the idle collectives (all 0) too
    assert op.op == "AllReduce"
    assert report.behind(comm, op) == [2]
    assert [(r.rank, r.node, r.pid) for r in comm.missing] == [(4, "10.30.0.3", 3304)]
    assert report.dead == []  # unresponsive, not (yet) considered dead
    first = elect_first_error(ras_evidence(report, CONTEXT)).first_error
    assert first is not None
    assert (first.lane, first.rank, first.node) == (Lane.ALGORITHM, 2, "10-30-0-2")


def test_json_that_is_not_a_ras_report_is_left_to_the_log_parsers():
    assert not is_ras_report('{"communicators": 3}')
    assert not is_ras_report('{"communicators": [')
    assert parse_ras('{"communicators": [1, {"ranks": [{"rank": "x"}], "missing_ranks": [null]}]}').dead == []
