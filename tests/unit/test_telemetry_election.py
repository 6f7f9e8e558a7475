"""First-error election on the scenarios of the telemetry issue, from realistic log lines."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from itertools import permutations
from pathlib import Path

from hypothesis import example, given, settings
from hypothesis import strategies as st

from lanes_cli.analyze_cli import load_evidence
from lanes_contract.events import EvidenceCategory as C
from lanes_contract.events import EvidenceData, Lane
from lanes_evidence.evidence import Evidence
from lanes_evidence.parsers import SourceContext, parse_text
from lanes_telemetry.domain.election import (
    HANG_READINGS,
    UNEXPLAINED_EXIT,
    Stage,
    World,
    elect_first_error,
    may_be_cause,
)

LOGS = Path(__file__).resolve().parent.parent / "data" / "logs"
EIGHT_RANKS = World(ranks={r: f"node-{r // 2 + 1}" for r in range(8)})


def _timeout_log(rank: int, *, seq: int = 1580, enqueued: int | None = None, at: str = "10:30:05") -> str:
    enqueued = seq if enqueued is None else enqueued
    return (
        f"[rank{rank}]:[E1202 {at}.392121 2211 ProcessGroupNCCL.cpp:616] [Rank {rank}] Watchdog caught collective "
        f"operation timeout: WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) "
        "ran for 600047 milliseconds before timing out.\n"
        f"[rank{rank}]:[E1202 {at}.392437 2211 ProcessGroupNCCL.cpp:1834] [PG ID 0 PG GUID 0(default_pg) Rank {rank}] "
        f"Timeout at NCCL work: {seq}, last enqueued NCCL work: {enqueued}, last completed NCCL work: {enqueued - 1}.\n"
    )


def _rank_logs(logs: dict[int, str]) -> list[Evidence]:
    found: list[Evidence] = []
    for rank, text in logs.items():
        found += parse_text(
            text, SourceContext(origin=f"rank{rank}.log", node=EIGHT_RANKS.ranks[rank], rank=rank, year=2026, tz=UTC)
        )
    return found


def _node_log(node: str, text: str) -> list[Evidence]:
    return parse_text(text, SourceContext(origin=f"{node}/kern.log", node=node, year=2026, tz=UTC))


def test_one_rank_oom_killed_from_a_directory_of_per_rank_logs():
    evidence, world = load_evidence([LOGS / "oom_job"], year=2026)
    finding = elect_first_error(evidence, world=world)
    first = finding.first_error
    assert first is not None
    assert (first.category, first.lane, first.node, first.rank) == ("oom_kill", Lane.HOST, "node-2", 3)
    assert first.time == datetime(2026, 12, 2, 10, 20, 4, tzinfo=UTC)
    assert any("Killed process 41233" in line for line in first.evidence)
    assert any("Signal 9 (SIGKILL)" in line for line in first.evidence)  # torchelastic's root cause joins the chain
    timeouts = next(g for g in finding.consequences if g.category == "collective_timeout")
    assert timeouts.summary == "6 ranks timed out in ALLREDUCE SeqNum=1580 after 600 s"
    assert timeouts.ranks == (0, 1, 4, 5, 6, 7)
    assert finding.stage == Stage.STEADY_STATE
    assert finding.confidence >= 0.8
    assert not finding.missing_evidence
    assert "host team" in finding.owner


def test_gpu_xid_79_on_one_node_explains_the_cuda_error_it_caused():
    kernel = (
        "[Wed Dec  2 10:21:13 2026] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, "
        "GPU has fallen off the bus.\n"
    )
    rank5 = (
        "[rank5]:[I1202 10:21:13.900000 7 train.py:120] step 4001\n"
        "[rank5]: RuntimeError: CUDA error: unspecified launch failure\n"
    )
    logs = {r: _timeout_log(r, at="10:31:14") for r in range(8) if r != 5} | {5: rank5}
    finding = elect_first_error(_rank_logs(logs) + _node_log("node-3", kernel), world=EIGHT_RANKS)
    first = finding.first_error
    assert first is not None
    assert (first.category, first.lane, first.node, first.rank) == ("gpu_xid", Lane.HOST, "node-3", 5)
    assert "Xid (PCI:0000:3b:00): 79" in first.evidence[0]
    assert any("unspecified launch failure" in line for line in first.evidence)
    assert finding.consequences[0].count == 7


def test_link_down_between_two_nodes_is_the_network_lane():
    kernel = "2026-12-02T10:23:01.004512+00:00 node-2 kernel: mlx5_core 0000:5e:00.0 ibp94s0: Link down\n"
    rank0 = _timeout_log(0, at="10:33:02") + (
        "[rank0]:[W1202 10:23:08.100000 7 train.py:1] slow step\n"
        "node-1:2201:2307 [0] transport/net_ib.cc:1696 NCCL WARN NET/IB : Got completion from peer 10.0.1.12<39875> "
        "with status=12 opcode=0 len=0 vendor err 129 (Recv)\n"
    )
    logs = {r: _timeout_log(r, at="10:33:02") for r in range(1, 8)} | {0: rank0}
    finding = elect_first_error(_rank_logs(logs) + _node_log("node-2", kernel), world=EIGHT_RANKS)
    first = finding.first_error
    assert first is not None
    assert (first.category, first.lane, first.node) == ("link_down", Lane.NETWORK, "node-2")
    assert first.evidence == (kernel.strip(),)
    assert any(g.category == "retry_exceeded" for g in finding.consequences)
    assert any(m.lane is Lane.NETWORK and m.node == "node-2" for m in finding.missing_evidence)
    assert "network team" in finding.owner


def test_python_exception_on_one_rank_is_the_algorithm_lane():
    rank3 = (
        "[rank3]:[I1202 10:20:00.000000 7 train.py:120] step 812\n"
        "[rank3]: Traceback (most recent call last):\n"
        '[rank3]:   File "/workspace/train.py", line 96, in step\n'
        '[rank3]:     logits = model(batch["input_ids"]).view(-1, cfg.vocab_size)\n'
        "[rank3]: RuntimeError: shape '[-1, 32000]' is invalid for input of size 4198400\n"
    )
    elastic = (
        "Root Cause (first observed failure):\n[0]:\n  time      : 2026-12-02_10:20:01\n  host      : node-2\n"
        "  rank      : 3 (local_rank: 1)\n  exitcode  : 1 (pid: 777)\n  error_file: <N/A>\n"
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n"
        "============================================================\n"
    )
    logs = {r: _timeout_log(r) for r in range(8) if r != 3} | {3: rank3}
    finding = elect_first_error(_rank_logs(logs) + _node_log("node-2", elastic), world=EIGHT_RANKS)
    first = finding.first_error
    assert first is not None
    assert (first.category, first.lane, first.node, first.rank) == ("python_exception", Lane.ALGORITHM, "node-2", 3)
    assert first.evidence[-1].endswith("for input of size 4198400") or any("exitcode  : 1" in x for x in first.evidence)
    assert "RuntimeError" in first.summary
    assert "algorithm team" in finding.owner


def test_pure_hang_sequence_numbers_identify_the_laggard():
    logs = {r: _timeout_log(r) for r in range(7)} | {7: _timeout_log(7, seq=1579, enqueued=1579)}
    finding = elect_first_error(_rank_logs(logs), world=EIGHT_RANKS)
    first = finding.first_error
    assert first is not None
    assert (first.category, first.rank, first.node, first.lane) == (
        "collective_not_enqueued",
        7,
        "node-4",
        Lane.ALGORITHM,
    )
    assert "never enqueued SeqNum=1580" in first.summary
    assert any(m.rank == 7 and "stack dump" in m.what for m in finding.missing_evidence)
    assert next(g for g in finding.consequences if "SeqNum=1580" in g.summary).count == 7


def test_hang_with_no_evidence_from_one_node_names_the_pending_evidence():
    logs = {r: _timeout_log(r) for r in range(6)}  # node-4 (ranks 6 and 7) said nothing
    finding = elect_first_error(_rank_logs(logs), world=EIGHT_RANKS)
    first = finding.first_error
    assert first is not None
    assert (first.category, first.node, first.lane) == ("silent_node", "node-4", Lane.HOST)
    assert "ranks 6-7" in first.summary
    pending = {(m.lane, m.node) for m in finding.missing_evidence}
    assert pending == {(Lane.HOST, "node-4"), (Lane.NETWORK, "node-4")}
    assert finding.confidence < 0.5


def test_collective_timeouts_alone_blame_the_network_only_when_nothing_else_explains_them():
    finding = elect_first_error(_rank_logs({r: _timeout_log(r) for r in range(8)}), world=EIGHT_RANKS)
    assert finding.first_error is not None
    assert (finding.first_error.category, finding.first_error.lane) == ("collective_hang", Lane.NETWORK)
    assert finding.confidence <= 0.3


def _evidence(category: C, node: str, at: datetime, rank: int | None = None, **data: object) -> Evidence:
    return Evidence(EvidenceData(category=category, lines=(f"{category} on {node}",), **data), at, node, rank)  # type: ignore[arg-type]


T0 = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)


def test_clock_offset_of_a_node_reorders_causes():
    evidence = [
        _evidence(C.OOM_KILL, "node-2", T0, pid=1),
        _evidence(C.GPU_XID, "node-1", T0 + timedelta(seconds=10), xid=79),
    ]
    assert elect_first_error(evidence).first_error.node == "node-2"  # type: ignore[union-attr]
    skewed = [*evidence, _evidence(C.CLOCK_OFFSET, "node-1", T0, offset_ms=15_000.0)]
    assert elect_first_error(skewed).first_error.node == "node-1"  # type: ignore[union-attr]


def test_sequence_numbers_win_over_timestamps():
    # rank 1's exception is earlier by the clock, but rank 1 went on completing collectives after rank 0 stopped.
    evidence = [
        _evidence(C.PYTHON_EXCEPTION, "node-1", T0, rank=1),
        _evidence(C.COLLECTIVE_TIMEOUT, "node-1", T0 - timedelta(seconds=1), rank=1, seq_num=90, last_completed=89),
        _evidence(C.PYTHON_EXCEPTION, "node-2", T0 + timedelta(seconds=30), rank=0),
        _evidence(C.COLLECTIVE_TIMEOUT, "node-2", T0, rank=0, seq_num=41, last_completed=40),
    ]
    assert elect_first_error(evidence).first_error.rank == 0  # type: ignore[union-attr]


def test_stage_first_collective_and_init():
    first = elect_first_error(_rank_logs({r: _timeout_log(r, seq=1) for r in range(8)}), world=EIGHT_RANKS)
    assert first.stage == Stage.FIRST_COLLECTIVE
    init = elect_first_error(
        parse_text(
            "node-2:5520:5520 [0] bootstrap.cc:77 NCCL WARN Bootstrap : no socket interface found\n",
            SourceContext(year=2026, tz=UTC),
        )
    )
    assert init.stage == Stage.INIT_RENDEZVOUS
    assert init.first_error is not None
    assert (init.first_error.category, init.first_error.lane) == ("config_mismatch", Lane.PLATFORM)


def test_no_evidence_elects_nothing():
    finding = elect_first_error([])
    assert finding.first_error is None
    assert finding.confidence == 0.0
    assert finding.stage == Stage.UNKNOWN


def test_election_is_independent_of_input_order():
    evidence, world = load_evidence([LOGS / "oom_job"], year=2026)
    assert elect_first_error(evidence, world=world) == elect_first_error(list(reversed(evidence)), world=world)


def test_checkpoint_and_teardown_stages_from_the_failing_code_path():
    def failing(frame: str) -> list[Evidence]:
        text = (
            "[rank2]:[I1202 10:00:00.000000 7 train.py:1] step 900\n"
            "[rank2]: Traceback (most recent call last):\n"
            f'[rank2]:   File "/workspace/train.py", line 300, in {frame}\n'
            "[rank2]: OSError: [Errno 5] Input/output error\n"
        )
        return parse_text(text, SourceContext(node="node-2", rank=2, year=2026, tz=UTC)) + _rank_logs(
            {0: _timeout_log(0, seq=4000)}
        )

    assert elect_first_error(failing("save_checkpoint"), world=EIGHT_RANKS).stage == Stage.CHECKPOINT
    assert elect_first_error(failing("destroy_process_group"), world=EIGHT_RANKS).stage == Stage.TEARDOWN
    assert elect_first_error(failing("train_step"), world=EIGHT_RANKS).stage == Stage.STEADY_STATE


def test_one_combined_torchrun_log_with_rank_prefixes():
    text = "".join(_timeout_log(r) for r in (0, 1, 2)) + (
        "[rank3]:[I1202 10:20:00.000000 7 train.py:120] step 812\n"
        "[rank3]: Traceback (most recent call last):\n"
        '[rank3]:   File "/workspace/train.py", line 96, in step\n'
        "[rank3]: ValueError: batch 812 has no labels\n"
    )
    finding = elect_first_error(parse_text(text, SourceContext(origin="torchrun.log", year=2026, tz=UTC)))
    assert finding.first_error is not None
    assert (finding.first_error.rank, finding.first_error.lane) == (3, Lane.ALGORITHM)
    assert finding.consequences[0].ranks == (0, 1, 2)


_categories = st.sampled_from(list(C))
_CONSEQUENTIAL_CAUSES = {C.PROCESS_EXITED, C.COMM_INIT_FAILURE}
"""Possible causes that count as consequences when they follow the same rank's own timeout."""
_evidence_strategy = st.builds(
    Evidence,
    data=st.builds(
        EvidenceData,
        category=_categories,
        lines=st.tuples(st.text(max_size=20)),
        seq_num=st.none() | st.integers(0, 5000),
        last_enqueued=st.none() | st.integers(0, 5000),
        last_completed=st.none() | st.integers(0, 5000),
        pid=st.none() | st.integers(0, 50),
        signal=st.none() | st.integers(1, 15),
        exit_code=st.none() | st.integers(-2, 2),
        peer=st.none() | st.sampled_from(["node-1", "node-2", "10.0.0.1"]),
        offset_ms=st.none() | st.floats(-1e6, 1e6),
    ),
    time=st.none()
    | st.datetimes(min_value=datetime(2026, 1, 1), max_value=datetime(2026, 1, 2), timezones=st.just(UTC)),  # noqa: DTZ001 - bounds of a strategy given a timezone
    node=st.none() | st.sampled_from(["node-1", "node-2", "node-3"]),
    rank=st.none() | st.integers(0, 7),
)


@settings(max_examples=200, deadline=None)
@given(evidence=st.lists(_evidence_strategy, max_size=40))
@example(  # found by CI's random-seed job: an exception logged a day after the exit does not explain it
    evidence=[
        Evidence(EvidenceData(category=C.COLLECTIVE_TIMEOUT, lines=("",))),
        Evidence(
            EvidenceData(category=C.PROCESS_EXITED, lines=("",), exit_code=1), time=datetime(2026, 1, 1, tzinfo=UTC)
        ),
        Evidence(EvidenceData(category=C.PYTHON_EXCEPTION, lines=("",)), time=datetime(2026, 1, 2, tzinfo=UTC)),
    ]
)
def test_election_never_raises_is_order_independent_and_prefers_causes(evidence):
    finding = elect_first_error(evidence, world=EIGHT_RANKS)
    assert finding == elect_first_error(list(reversed(evidence)), world=EIGHT_RANKS)
    assert 0.0 <= finding.confidence <= 1.0
    if any(may_be_cause(e) for e in evidence):
        # A possible cause may still be a consequence (a rank exiting with an error after its own
        # collective timed out): then the hang is read instead, and may name a silent node or rank; an exit
        # status nothing explains is elected as what it is, an unexplained exit.
        assert finding.first_error is not None
        assert finding.first_error.category in {c.value for c in C} | HANG_READINGS | {UNEXPLAINED_EXIT}
    if any(e.category not in _CONSEQUENTIAL_CAUSES and may_be_cause(e) for e in evidence):
        # Not a hang reading: a cause, or an exit that came before any cause (one logged later explains nothing).
        assert finding.first_error is not None
        assert finding.first_error.category in {c.value for c in C} | {UNEXPLAINED_EXIT}


def test_evidence_alike_in_time_place_category_and_lines_but_not_in_peer_elects_the_same_either_way():
    # Found by the random-seed property run: three init failures tie on everything the sort looked at, and
    # the one naming a peer led or not depending on arrival, which changed the consequence groups.
    alike = [EvidenceData(category=C.COMM_INIT_FAILURE, lines=("",)) for _ in range(2)]
    evidence = [
        Evidence(EvidenceData(category=C.COLLECTIVE_TIMEOUT, lines=("",))),
        *(Evidence(data) for data in alike),
        Evidence(EvidenceData(category=C.COMM_INIT_FAILURE, lines=("",), peer="node-1")),
    ]
    findings = [elect_first_error(order, world=EIGHT_RANKS) for order in permutations(evidence)]
    assert all(finding == findings[0] for finding in findings)


def test_sockets_closed_by_one_peer_name_that_peer_when_nothing_else_explains_it():
    evidence = [_evidence(C.PEER_CLOSED, f"node-{n}", T0, rank=n, peer="node-4.cluster.local") for n in (1, 2, 3)] + [
        _evidence(C.PEER_CLOSED, "node-1", T0, rank=0, peer="fe80::1%ib0")
    ]
    first = elect_first_error(evidence).first_error
    assert first is not None
    assert (first.category, first.node, first.lane) == ("peer_lost", "node-4", Lane.HOST)


def test_hang_where_one_rank_says_nothing_on_a_node_that_reports_names_that_rank():
    quiet = "[rank5]:[I1202 10:20:00.000000 7 train.py:120] step 812\n"  # alive, then nothing: no timeout of its own
    logs = {r: _timeout_log(r) for r in range(8) if r != 5} | {5: quiet}
    finding = elect_first_error(_rank_logs(logs), world=EIGHT_RANKS)
    first = finding.first_error
    assert first is not None
    assert (first.category, first.rank, first.node, first.lane) == ("silent_rank", 5, "node-3", Lane.ALGORITHM)
    assert [(m.lane, m.rank) for m in finding.missing_evidence] == [(Lane.PLATFORM, 5)]
    assert "rank 5" in finding.missing_evidence[0].what


def _gloo_timeout(rank: int, node: str) -> list[Evidence]:
    text = (
        f"[rank{rank}]: RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
        "Timed out waiting 15000ms for recv operation to complete\n"
    )
    return parse_text(text, SourceContext(origin=f"rank{rank}.log", node=node, rank=rank, year=2026, tz=UTC))


def _teardown_exit(rank: int, node: str) -> Evidence:
    data = EvidenceData(category=C.PROCESS_EXITED, summary=f"rank {rank} killed by signal 15", signal=15)
    return Evidence(data=data, time=datetime(2026, 12, 2, 10, 31, tzinfo=UTC), node=node, rank=rank)


def test_a_stopped_rank_that_the_teardown_ended_is_still_the_silent_one_its_peers_waited_for():
    # One rank per node (a drill's SIGSTOP): three ranks time out in gloo, the stopped one says nothing, and
    # its only trace is the SIGTERM (enforced by SIGKILL) of the gang's teardown. That exit is no report.
    world = World(ranks={r: f"node-{r + 1}" for r in range(4)})
    evidence = [e for r in (0, 1, 3) for e in _gloo_timeout(r, f"node-{r + 1}")]
    evidence += [_teardown_exit(r, f"node-{r + 1}") for r in range(4)]
    first = elect_first_error(evidence, world=world).first_error
    assert first is not None
    assert (first.category, first.lane, first.node, first.rank) == ("silent_node", Lane.HOST, "node-3", 2)
    # Two ranks on the stopped rank's node, the other one timing out: the silent rank, not its node.
    shared = World(ranks={0: "node-1", 1: "node-1", 2: "node-2", 3: "node-2"})
    evidence = [e for r, n in ((0, "node-1"), (1, "node-1"), (3, "node-2")) for e in _gloo_timeout(r, n)]
    evidence += [_teardown_exit(r, shared.ranks[r] or "") for r in range(4)]
    first = elect_first_error(evidence, world=shared).first_error
    assert first is not None
    assert (first.category, first.rank) == ("silent_rank", 2)
