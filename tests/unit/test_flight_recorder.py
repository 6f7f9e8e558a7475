"""PyTorch Flight Recorder dumps as evidence, on real dumps of a 4-rank gloo job where rank 2 hung before collective 4.

The dumps under tests/data/flight_recorder/hang_rank2 were written by bench/flight_recorder_dumps.py (see the
README there). The mismatch and hostile cases below are derived from them in memory, and say so.
"""

from __future__ import annotations

import json
import pickle
import shutil
from datetime import UTC
from pathlib import Path
from typing import Any

import pytest
from accuracy import flight_recorder_drills  # bench/accuracy.py: bench/ is on the test path (pyproject)
from typer.testing import CliRunner

from lanes_cli.cli import app
from lanes_contract.events import EvidenceCategory as C
from lanes_evidence.flight_recorder import (
    MAX_DEPTH,
    MAX_DUMP_BYTES,
    MAX_VALUES,
    FlightRecorderError,
    FrDump,
    analyze_dumps,
    describe,
    flight_recorder_evidence,
    is_flight_recorder_dump,
    parse_dump,
    rank_of_name,
)
from lanes_evidence.parsers import SourceContext
from lanes_telemetry.views import World, elect_first_error

HANG = Path(__file__).resolve().parent.parent / "data" / "flight_recorder" / "hang_rank2"
MISMATCH = HANG.parent / "mismatch_rank1"
runner = CliRunner()


def _dumps(skip: frozenset[int] = frozenset()) -> dict[int, FrDump]:
    found: dict[int, FrDump] = {}
    for path in sorted(HANG.glob("rank_*.json")):
        rank = rank_of_name(path.name)
        assert rank is not None
        if rank not in skip:
            found[rank] = parse_dump(path.read_bytes(), rank=rank, origin=path.name)
    return found


def test_a_real_gloo_dump_is_read_entry_by_entry():
    dump = _dumps()[0]
    assert [e.seq for e in dump.entries] == [1, 2, 3, 4]
    last = dump.entries[-1]
    assert (last.pg, last.op, last.input_sizes, last.output_sizes) == ("0", "gloo:all_reduce", ((8,),), ((8,),))
    assert last.state == "scheduled"  # gloo records neither start nor end: see the data's README
    assert last.time_created_ns > 0
    assert last.timeout_ms == 3000
    assert dump.group_sizes == {"": 4}


def test_the_rank_that_never_entered_collective_4_is_named():
    analysis = analyze_dumps(_dumps())
    assert [(lag.rank, lag.last_seq, lag.waited_on, lag.ahead) for lag in analysis.laggards] == [(2, 3, 4, 3)]
    assert analysis.divergent == []
    assert analysis.missing == []


def test_a_deleted_dump_is_missing_evidence_that_says_what_it_would_settle():
    analysis = analyze_dumps(_dumps(skip=frozenset({2})))
    assert analysis.laggards == []  # the three present ranks agree: nothing to blame from them alone
    (missing,) = analysis.missing
    assert (missing.rank, missing.waited_on) == (2, 4)
    assert describe(analysis) == ["rank 2's dump is missing: it would settle whether rank 2 entered collective 4"]
    # The election says so: the three dumps read as evidence, rank 2 still in the world.
    context = SourceContext(origin="dumps", node=None, rank=None, year=None, tz=UTC)
    world = World(ranks=dict.fromkeys(range(4)), nodes=frozenset())
    finding = elect_first_error(flight_recorder_evidence(analysis, context), world=world)
    (pending,) = [m for m in finding.missing_evidence if "Flight Recorder" in m.what]
    assert pending.rank == 2
    assert pending.what == (
        "rank 2's Flight Recorder dump is missing: it would settle whether rank 2 entered collective 4 (ALLREDUCE)"
    )


def test_absent_dumps_on_one_node_are_one_line_of_pending_evidence():
    analysis = analyze_dumps(_dumps(skip=frozenset({1, 2, 3})))
    context = SourceContext(origin="dumps", node="n1", rank=None, year=None, tz=UTC)
    world = World(ranks={0: "n1", 1: "n2", 2: "n2", 3: "n2"}, nodes=frozenset({"n1", "n2"}))
    finding = elect_first_error(flight_recorder_evidence(analysis, context), world=world)
    assert [(m.node, m.rank, m.what) for m in finding.missing_evidence if "Flight Recorder" in m.what] == [
        (
            "n2",
            None,
            (
                "ranks 1-3' Flight Recorder dumps are missing: they would settle whether ranks 1-3 entered "
                "collective 4 (ALLREDUCE)"
            ),
        )
    ]


def test_an_expected_world_size_names_missing_ranks_beyond_the_dumps():
    analysis = analyze_dumps(_dumps(), world_size=6)
    assert [m.rank for m in analysis.missing] == [4, 5]


def test_a_rank_with_other_sizes_at_a_collective_is_the_odd_one_out():
    # Derived from the real dumps: rank 1's collective 2 is rewritten as a 16-float all-reduce.
    raw = json.loads((HANG / "rank_1.json").read_bytes())
    raw["entries"][1]["input_sizes"] = [[16]]
    dumps = _dumps()
    dumps[1] = parse_dump(json.dumps(raw).encode(), rank=1, origin="rank_1.json (edited)")
    analysis = analyze_dumps(dumps)
    (odd,) = analysis.divergent
    assert (odd.rank, odd.seq, odd.called, odd.majority, odd.majority_count) == (
        1,
        2,
        "gloo:all_reduce[16]",
        "gloo:all_reduce[8]",
        3,
    )
    evidence = flight_recorder_evidence(analysis, SourceContext(origin="fr", year=None, tz=UTC))
    (mismatch,) = [e for e in evidence if e.category is C.COLLECTIVE_MISMATCH]
    assert (mismatch.rank, mismatch.data.seq_num, mismatch.data.op_type) == (1, 2, "ALLREDUCE")


def test_a_real_mismatch_names_the_rank_that_broadcast_where_the_others_all_reduced():
    finding = _analyze(str(MISMATCH))
    first = finding["first_error"]
    assert (first["rank"], first["category"], first["lane"]) == (1, "collective_mismatch", "algorithm")
    assert "gloo:broadcast[8] at collective 3" in first["summary"]


def test_each_rank_reports_its_last_collective_as_the_election_reads_a_timeout():
    analysis = analyze_dumps(_dumps())
    evidence = flight_recorder_evidence(analysis, SourceContext(origin="fr", year=None, tz=UTC))
    last = {e.rank: e.data.last_enqueued for e in evidence if e.category is C.COLLECTIVE_TIMEOUT}
    assert last == {0: 4, 1: 4, 2: 3, 3: 4}
    assert all(e.time is not None for e in evidence)


def test_the_pickle_form_is_read_but_no_class_is_admitted():
    raw = json.loads((HANG / "rank_2.json").read_bytes())
    dump = parse_dump(pickle.dumps(raw), rank=2, origin="rank_2.pkl")
    assert [e.seq for e in dump.entries] == [1, 2, 3]
    assert is_flight_recorder_dump(pickle.dumps(raw))
    hostile = pickle.dumps({"entries": [Path("/etc/passwd")]})  # any class: a dump holds none
    with pytest.raises(FlightRecorderError, match="holds no classes"):
        parse_dump(hostile, rank=0, origin="evil.pkl")


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"{" * 10 + b"}" * 10, "not a readable"),
        (b"[1, 2]", "top level is list"),
        (json.dumps({"entries": {"a": 1}}).encode(), "`entries` is dict"),
        (json.dumps({"entries": [], "x": [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]}).encode(), f"deeper than {MAX_DEPTH}"),
        (b" " * (MAX_DUMP_BYTES + 1), "over the"),
    ],
)
def test_bad_dumps_are_refused_with_one_line(data: bytes, reason: str):
    with pytest.raises(FlightRecorderError, match=reason) as caught:
        parse_dump(data, rank=0, origin="bad.json")
    assert "\n" not in str(caught.value)
    assert str(caught.value).startswith("bad.json: ")


def test_a_pickle_that_repeats_one_list_by_reference_is_refused_not_walked():
    # A few MiB of pickle, a trillion values once expanded: the walk stops at its bound.
    row = list(range(1_000_000))
    hostile = pickle.dumps({"entries": [], "rows": [row] * 1_000_000})
    assert len(hostile) < MAX_DUMP_BYTES
    with pytest.raises(FlightRecorderError, match=f"more than {MAX_VALUES} values"):
        parse_dump(hostile, rank=0, origin="rows.pkl")


def test_the_rank_comes_from_the_file_name():
    assert rank_of_name("rank_3.json") == 3
    assert rank_of_name("nccl_trace_rank_12") == 12
    assert rank_of_name("trace.json") is None


def _analyze(*args: str) -> dict[str, Any]:
    result = runner.invoke(app, ["analyze", *args, "--json"])
    assert result.exit_code in {0, 1}, result.output
    body: dict[str, Any] = json.loads(result.output)
    return body


def test_lanes_analyze_names_the_hung_rank_and_its_collective():
    finding = _analyze(str(HANG))
    first = finding["first_error"]
    assert first["rank"] == 2
    assert "SeqNum=4" in first["summary"]
    assert not any("dump is missing" in m["what"] for m in finding["missing_evidence"])


def test_lanes_analyze_with_a_deleted_dump_says_which_is_missing(tmp_path: Path):
    for rank in (0, 1, 3):
        shutil.copy(HANG / f"rank_{rank}.json", tmp_path / f"rank_{rank}.json")
    finding = _analyze(str(tmp_path))
    whats = [m["what"] for m in finding["missing_evidence"]]
    assert any(
        w.startswith("rank 2's Flight Recorder dump is missing: it would settle whether rank 2 entered collective 4")
        for w in whats
    )
    assert finding["first_error"]["rank"] == 2  # the only rank that said nothing, while three waited


def test_lanes_analyze_reads_dumps_beside_logs(tmp_path: Path):
    shutil.copytree(HANG, tmp_path / "dumps")
    (tmp_path / "rank0.log").write_text("starting step 1\n")
    finding = _analyze(str(tmp_path / "dumps"), str(tmp_path / "rank0.log"))
    assert finding["first_error"]["rank"] == 2


def test_lanes_analyze_refuses_a_hostile_dump_in_one_line(tmp_path: Path):
    (tmp_path / "rank_0.pkl").write_bytes(pickle.dumps({"entries": [Path("/")]}))
    result = runner.invoke(app, ["analyze", str(tmp_path)])
    assert result.exit_code not in {0, 1}
    assert "holds no classes" in result.output


def test_the_accuracy_bench_drills_name_the_hung_rank_and_each_deleted_dump():
    drills = flight_recorder_drills()
    assert drills["all_dumps_present"] == {"drills": 2, "rank_accuracy": 1.0}
    assert drills["one_dump_deleted"] == {"drills": 8, "missing_named": 1.0}
    assert drills["misses"] == []
