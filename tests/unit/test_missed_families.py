"""The log families the first-error election used to miss (issue 38): what each line becomes, who is elected."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from lanes_cli.analyze_cli import load_evidence
from lanes_contract.events import EvidenceCategory as C
from lanes_contract.events import Lane
from lanes_evidence.evidence import DRIVER_MODULE_MISMATCH, Evidence, evidence_event, lane_of
from lanes_evidence.parsers import SourceContext, parse_text
from lanes_telemetry.views import World, elect_first_error

CONTEXT = SourceContext(origin="sample", year=2026, tz=UTC)
UNDATED = datetime(2026, 12, 4, tzinfo=UTC)
"""When an undated line is published."""


def _one(text: str, context: SourceContext = CONTEXT) -> Evidence:
    (found,) = [e for e in parse_text(text, context) if e.category is not C.RAW]
    return found


def _parsed(files: dict[str, str], tmp_path: Path) -> tuple[list[Evidence], World]:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return load_evidence([tmp_path], year=2026, tz=UTC)


# --- parsers ---------------------------------------------------------------------------------------


def test_nvls_cuda_failure_behind_a_launcher_stamp_is_a_platform_setup_fault():
    line = "[2026-12-04 09:00:03] n1:41:42 [1] transport/nvls.cc:254 NCCL WARN Cuda failure 401 'the operation cannot'"
    found = _one(line)
    assert (found.category, found.node, found.data.pid) == (C.CONFIG_MISMATCH, "n1", 41)
    assert found.data.summary.startswith("NVLink SHARP (NVLS)")
    assert found.time is not None
    assert (found.time.hour, found.time.second) == (9, 3)  # the stamp is the time
    assert lane_of(found.data) is Lane.PLATFORM


def test_a_cuda_failure_outside_nvls_stays_a_cuda_error():
    found = _one("n1:41:42 [1] transport/p2p.cc:10 NCCL WARN Cuda failure 700 'an illegal memory access'")
    assert found.category is C.CUDA_ERROR


@pytest.mark.parametrize(
    "line",
    [
        "Failed to initialize NVML: Driver/library version mismatch",
        "Dec  4 09:54:30 node-2 kernel: NVRM: API mismatch: the client has the version 550.127.05, but",
    ],
)
def test_a_driver_at_odds_with_its_kernel_module_is_the_hosts(line: str):
    found = _one(line)
    assert (found.category, found.data.summary) == (C.CONFIG_MISMATCH, DRIVER_MODULE_MISMATCH)
    assert lane_of(found.data) is Lane.HOST
    event = evidence_event(found, source="agent/node-2", node="node-2", time=found.time or UNDATED)
    assert event.lane is Lane.HOST  # the published event carries the same lane the election gives


def test_cuda_error_803_is_an_image_against_the_driver_not_the_models_code():
    found = _one("[rank6]: RuntimeError: CUDA error: system has unsupported display driver / cuda driver combination")
    assert (found.category, found.rank) == (C.CONFIG_MISMATCH, 6)
    assert lane_of(found.data) is Lane.PLATFORM


@pytest.mark.parametrize(
    ("line", "rank"),
    [
        (
            (
                "[ERROR] HCCL(8801,python):2026-12-04-12:30:00.000.020 [hccl_socket.cc:150][8801][RankID:1] EI0006: "
                "Getting socket times out. Reason: Remote Rank did not send the data in time."
            ),
            1,
        ),
        ("[rank2]: EI0002: The wait execution of the Notify register times out. Reason: no record came", 2),
    ],
)
def test_hccl_waits_on_a_remote_rank_are_timeouts_of_the_waiting_rank(line: str, rank: int):
    found = _one(line)
    assert (found.category, found.rank) == (C.COLLECTIVE_TIMEOUT, rank)


# --- the election ------------------------------------------------------------------------------------


def _nccl_timeout(rank: int, at: str) -> str:
    return (
        f"[rank{rank}]:[E1204 {at} 9000 ProcessGroupNCCL.cpp:616] [Rank {rank}] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=44, OpType=ALLREDUCE, NumelIn=8, NumelOut=8, Timeout(ms)=600000) ran for 600042 "
        "milliseconds before timing out.\n"
    )


_RENDEZVOUS = "  group_rank=1\n  group_world_size=2\n  local_ranks=[0, 1]\n  global_ranks=[2, 3]\n"


def test_a_lost_gpu_is_the_rank_torchrun_started_on_that_node_and_never_heard_from(tmp_path: Path):
    evidence, world = _parsed(
        {
            "node-1/rank0.log": _nccl_timeout(0, "08:41:10.100000"),
            "node-2/torchrun.log": _RENDEZVOUS,
            "node-2/rank2.log": _nccl_timeout(2, "08:41:10.300000"),
            "node-2/kern.log": "Dec  4 08:31:02 node-2 kernel: NVRM: Xid (PCI:0000:9d:00): 79, pid='<unknown>', "
            "name=<unknown>, GPU has fallen off the bus.\n",
        },
        tmp_path,
    )
    assert world.ranks[3] == "node-2"  # from the rendezvous result, though rank 3 wrote nothing
    finding = elect_first_error(evidence, world=world)
    first = finding.first_error
    assert first is not None
    assert (first.lane, first.node, first.rank, first.category) == (Lane.HOST, "node-2", 3, "gpu_xid")
    # the silent rank is named as evidence still to come, with its node
    assert any(m.rank == 3 and m.node == "node-2" for m in finding.missing_evidence)


def test_without_the_rendezvous_result_two_silent_ranks_leave_the_gpu_unattributed(tmp_path: Path):
    evidence, world = _parsed(
        {
            "node-2/rank2.log": _nccl_timeout(2, "08:41:10.300000"),
            "node-2/rank3.log": "",
            "node-2/rank4.log": "",
            "node-2/kern.log": "Dec  4 08:31:02 node-2 kernel: NVRM: Xid (PCI:0000:9d:00): 79, pid='<unknown>', "
            "GPU has fallen off the bus.\n",
        },
        tmp_path,
    )
    first = elect_first_error(evidence, world=world).first_error
    assert first is not None
    assert (first.lane, first.node, first.rank) == (Lane.HOST, "node-2", None)  # 3 or 4: no guess


def test_an_nvlink_xid_149_takes_the_rank_of_the_pid_its_xid_45_cleaned_up(tmp_path: Path):
    evidence, world = _parsed(
        {
            "node-1/kern.log": (
                "Dec  4 17:00:00 node-1 kernel: NVRM: Xid (PCI:0000:1b:00): 149, pid='<unknown>', name=<unknown>, "
                "NETIR_LINK_EVT Fatal error detected on link 9\n"
                "Dec  4 17:00:01 node-1 kernel: NVRM: Xid (PCI:0000:1b:00): 45, pid=4412, name=python3, Ch 00000010\n"
                "Dec  4 17:00:01 node-1 kernel: NVRM: Xid (PCI:0000:18:00): 45, pid=4411, name=python3, Ch 00000010\n"
            ),
            "node-1/rank0.log": "node-1:4411:4470 [0] NCCL INFO comm 0x1 rank 0 nranks 2 - Init COMPLETE\n",
            "node-1/rank1.log": "node-1:4412:4471 [1] NCCL INFO comm 0x2 rank 1 nranks 2 - Init COMPLETE\n",
        },
        tmp_path,
    )
    first = elect_first_error(evidence, world=world).first_error
    assert first is not None
    assert (first.lane, first.rank, first.category) == (Lane.HOST, 1, "gpu_xid")
    assert "Xid 149" in first.summary


def _mismatch(me: int, other: int, mine: str, theirs: str) -> str:
    def fingerprint(op: str) -> str:
        return f"CollectiveFingerPrint(SequenceNumber=57, OpType={op}, TensorShape=[8], TensorDtypes=Float)"

    return (
        f"[rank{me}]: RuntimeError: Detected mismatch between collectives on ranks. Rank {me} is running collective: "
        f"{fingerprint(mine)}, but Rank {other} is running collective: {fingerprint(theirs)}.\n"
    )


def test_a_collective_mismatch_blames_the_odd_one_out_not_the_first_reporter():
    evidence: list[Evidence] = []
    for rank in (0, 1, 2):
        evidence += parse_text(_mismatch(rank, 3, "ALLREDUCE", "ALLGATHER"), CONTEXT)
    first = elect_first_error(evidence, world=World(ranks=dict.fromkeys(range(4), "node-1"))).first_error
    assert first is not None
    assert (first.lane, first.rank, first.node) == (Lane.ALGORITHM, 3, "node-1")
    assert "rank 3 called ALLGATHER where 3 ranks called ALLREDUCE" in first.summary


def test_one_mismatch_report_is_settled_by_the_collective_the_others_wait_in():
    evidence = parse_text(_mismatch(0, 5, "ALLREDUCE", "BROADCAST"), CONTEXT)
    for rank in range(1, 5):
        evidence += parse_text(_nccl_timeout(rank, f"19:30:0{rank}.000000"), CONTEXT)
    first = elect_first_error(evidence).first_error
    assert first is not None
    assert (first.lane, first.rank) == (Lane.ALGORITHM, 5)


def test_a_one_against_one_mismatch_keeps_the_reporter():
    first = elect_first_error(parse_text(_mismatch(1, 0, "BROADCAST", "ALLREDUCE"), CONTEXT)).first_error
    assert first is not None
    assert (first.lane, first.rank) == (Lane.ALGORITHM, 1)


def test_hccl_ranks_waiting_on_a_stuck_remote_name_the_rank_that_said_nothing(tmp_path: Path):
    waiting = {
        f"ascend-1/rank{r}.log": f"[ERROR] HCCL(880{r},python):2026-12-04-12:30:00.000.0{r}0 [s.cc:150][880{r}]"
        f"[RankID:{r}] EI0006: Getting socket times out. Reason: Remote Rank did not send the data in time.\n"
        for r in range(3)
    }
    stuck = {"ascend-1/rank3.log": "[INFO] HCCL(8803,python):2026-12-04-12:00:00.000.000 [c.cc:1][8803] init done\n"}
    evidence, world = _parsed(waiting | stuck, tmp_path)
    first = elect_first_error(evidence, world=world).first_error
    assert first is not None
    assert (first.category, first.lane, first.rank) == ("silent_rank", Lane.ALGORITHM, 3)


def test_driver_mismatch_beats_the_cuda_error_it_causes_and_keeps_that_ranks_number(tmp_path: Path):
    evidence, world = _parsed(
        {
            "node-5/journal.log": "Dec 04 14:00:00 node-5 kernel: NVRM: API mismatch: the client has the version 2\n",
            "node-5/rank6.log": "[rank6]: RuntimeError: CUDA error: system has unsupported display driver / cuda "
            "driver combination\n",
        },
        tmp_path,
    )
    first = elect_first_error(evidence, world=world).first_error
    assert first is not None
    assert (first.lane, first.node, first.rank) == (Lane.HOST, "node-5", 6)


def test_a_size_mismatch_without_fingerprints_still_names_its_reporter():
    line = "[rank2]: RuntimeError: [gloo/transport/tcp/pair.cc:446] Message truncated : received 8 bytes instead of 4"
    first = elect_first_error(parse_text(line, CONTEXT)).first_error
    assert first is not None
    assert (first.category, first.lane, first.rank) == ("collective_mismatch", Lane.ALGORITHM, 2)
