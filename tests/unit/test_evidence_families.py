"""One test per failure family of the first-error corpus: the line as it is really written, what it becomes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from lanes_contract.events import EvidenceCategory as C
from lanes_contract.events import Lane
from lanes_evidence.evidence import Evidence
from lanes_evidence.parsers import SourceContext, clock_of, parse_text, split_prefixes
from lanes_telemetry.views import World, elect_first_error

CONTEXT = SourceContext(origin="sample", year=2026, tz=UTC)


def _elected(found: list[Evidence]) -> list[Evidence]:
    return [e for e in found if e.category is not C.RAW]


def _one(text: str, context: SourceContext = CONTEXT) -> Evidence:
    (found,) = _elected(parse_text(text, context))
    return found


@pytest.mark.parametrize(
    ("line", "category", "rank"),
    [
        # hardware read as user code
        ("[rank5]: RuntimeError: CUDA error: uncorrectable ECC error encountered", C.ECC_ERROR, 5),
        ("86:00.0 3D controller: NVIDIA Corporation GH100 [H100 SXM5 80GB] (rev ff)", C.GPU_XID, None),
        ("Unable to determine the device handle for GPU 0000:86:00.0: Unknown Error", C.GPU_XID, None),
        # platform and configuration
        (
            "h1:20:20 [1] init.cc:871 NCCL WARN Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000",
            C.CONFIG_MISMATCH,
            None,
        ),
        ("h1:88:140 [0] transport/p2p.cc:275 NCCL WARN Cuda failure 'invalid argument'", C.CONFIG_MISMATCH, None),
        ("h1:88:140 [0] bootstrap.cc:77 NCCL WARN Bootstrap : no socket interface found", C.CONFIG_MISMATCH, None),
        (
            (
                "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d "
                "store has "
                "failed. See inner exception for details."
            ),
            C.RENDEZVOUS_FAILURE,
            None,
        ),
        (
            (
                "[rank3]:[W1203 04:00:00.001000 330 socket.cpp:752] [c10d] The client socket has timed out after "
                "1800s while "
                "trying to connect to (10.8.0.1, 29500)."
            ),
            C.RENDEZVOUS_FAILURE,
            3,
        ),
        (
            "[rank0]:[E1203 03:00:00.000000 311 init.cc:100] Caught signal 7 (Bus error: nonexistent physical address)",
            C.RESOURCE_EXHAUSTED,
            0,
        ),
        (
            (
                "EJ0001: [PID: 41220] 2026-12-01-09:00:03.443.120 Failed to initialize the HCCP process. Reason: "
                "Maybe the "
                "last training process is running."
            ),
            C.RESOURCE_EXHAUSTED,
            None,
        ),
        (
            (
                "[rank1]: RuntimeError: Detected mismatch between collectives on ranks. Rank 1 is running collective: "
                "CollectiveFingerPrint(SequenceNumber=46, OpType=BROADCAST), but Rank 0 is running collective: "
                "CollectiveFingerPrint(SequenceNumber=46, OpType=ALLREDUCE)."
            ),
            C.COLLECTIVE_MISMATCH,
            1,
        ),
        (
            "h1:5511:5602 [1] transport/net.cc:1074 NCCL WARN Message truncated : received 8192 bytes instead of 4096",
            C.COLLECTIVE_MISMATCH,
            None,
        ),
        # network: the side that failed to connect
        (
            (
                "h2:3303:3380 [3] misc/socket.cc:484 NCCL WARN socketStartConnect: Connect to 10.0.0.5<43211> failed : "
                "Software caused connection abort"
            ),
            C.CONNECT_FAILED,
            None,
        ),
        (
            (
                "h7:7007:7080 [7] proxy.cc:1496 NCCL WARN [Proxy Service 7] Failed to execute operation Connect from "
                "rank 7, "
                "retcode 6"
            ),
            C.CONNECT_FAILED,
            7,
        ),
        (
            "[rank5]: NET/IB : Got completion from peer 10.1.0.7<55013> with error 12, opcode 1, len 0, vendor err 129",
            C.RETRY_EXCEEDED,
            5,
        ),
        # loss anomalies, with no rank prefix at all
        ("RuntimeError: Function 'MulBackward0' returned nan values in its 0th output.", C.NUMERIC_ANOMALY, None),
        ("[rank12]: AssertionError: Rank 12: found NaN in local grad norm in backward pass", C.NUMERIC_ANOMALY, 12),
        # Slurm
        ("srun: error: node-2: task 3: Exited with exit code 1", C.PROCESS_EXITED, 3),
        ("srun: error: node-4: task 6: Out Of Memory", C.OOM_KILL, 6),
        ("srun: error: Node failure on node-7", C.NODE_LOST, None),
        # added beyond the issue
        (
            "Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.",
            C.NUMERIC_ANOMALY,
            None,
        ),
        ("h1:100:100 [0] NCCL INFO NET/Socket : Using [0]docker0:172.17.0.1<0>", C.CONFIG_MISMATCH, None),
        ("The actor is dead because its node has died. Node Id: 1f2e3d4c", C.NODE_LOST, None),
        (
            "2026-12-03T02:00:00Z  Warning  Evicted  pod/w-2  The node was low on resource: ephemeral-storage.",
            C.PREEMPTION,
            None,
        ),
        (
            "h8:8803:8870 [3] transport/net_ib.cc:110 NCCL WARN NET/IB : Got async event : port error",
            C.COMM_ERROR,
            None,
        ),
    ],
)
def test_family(line: str, category: C, rank: int | None) -> None:
    found = _one(line)
    assert (found.category, found.rank) == (category, rank)


def test_ray_placement_group_without_enough_gpus_is_the_platform():
    line = "ValueError: Cannot provide a placement group of placement_group_specs=[{'GPU': 1.0}] within 1800 seconds."
    assert _one(line).category is C.RESOURCE_EXHAUSTED


def test_the_year_and_time_zone_have_no_default():
    with pytest.raises(TypeError):
        SourceContext(origin="x")  # type: ignore[call-arg]


def test_application_xids_are_the_codes_fault_and_xid_45_is_an_aftermath():
    mmu = _one("Dec  3 07:55:01 node-2 kernel: NVRM: Xid (PCI:0000:4e:00): 31, pid=3301, name=python, MMU Fault")
    assert (mmu.category, mmu.node) == (C.CUDA_ERROR, "node-2")
    assert mmu.data.pid == 3301  # the process the driver names: the node agent attributes the line by it
    fallen = _one("Dec  3 07:55:02 node-2 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, "
                  "GPU has fallen off the bus.")  # fmt: skip
    assert (fallen.category, fallen.data.pid) == (C.GPU_XID, None)  # no process named: the node's, not a rank's
    cleanup = parse_text("Dec  3 04:00:01 node-2 kernel: NVRM: Xid (PCI:0000:3b:00): 45, pid=3303, Ch 8", CONTEXT)
    assert [e.category for e in cleanup] == [C.RAW]


@pytest.mark.parametrize(
    ("line", "rank", "local", "node", "body"),
    [
        ("[default4]:[rank12]: boom", 12, 4, None, "boom"),
        ("[RANK 1] boom", 1, None, None, "boom"),
        ("[1,3]<stderr>:boom", 3, None, None, "boom"),
        ("3: Traceback (most recent call last):", 3, None, None, "Traceback (most recent call last):"),
        ("0: [rank5]: boom", 5, None, None, "boom"),  # srun's task of a per-node torchrun is not the rank
        ("worker-1: [rank5]: boom", 5, None, "worker-1", "boom"),
        ("(VllmWorker rank=2 pid=4412) ERROR 11-14 09:12:58 x", 2, None, None, "ERROR 11-14 09:12:58 x"),
        ("(RayTrainWorker pid=5678, ip=10.0.0.3) boom", None, None, "10.0.0.3", "boom"),
        ("[ERROR] HCCL(5530,python3):2026-11-30-18:20:10.210.300 [a.cc:1][5530][RankID:3] x", 3, None, None, None),
        ("RuntimeError: index 3 out of range", None, None, None, "RuntimeError: index 3 out of range"),
    ],
)
def test_nested_prefixes(line: str, rank: int | None, local: int | None, node: str | None, body: str | None) -> None:
    prefixes, rest = split_prefixes(line)
    assert (prefixes.rank, prefixes.local_rank, prefixes.node) == (rank, local, node)
    if body is not None:
        assert rest == body


def test_local_rank_maps_to_global_rank_from_node_rank_and_nproc_per_node():
    log = (
        "I1203 14:00:00.000000 900 api.py:188]   nproc_per_node   : 4\n"
        "I1203 14:00:02.000000 900 api.py:525]   group_rank=1\n"
        "I1203 14:00:02.000000 900 api.py:525]   group_world_size=2\n"
        "E1203 15:12:44.000000 900 api.py:869] failed (exitcode: -9) local_rank: 1 (pid: 9911) of binary: python3\n"
    )
    found = _one(log)
    assert (found.category, found.rank, found.data.signal) == (C.PROCESS_EXITED, 5, 9)


def test_local_rank_maps_from_the_rendezvous_result_even_when_it_comes_later():
    log = (
        "[default1]:Traceback (most recent call last):\n"
        "[default1]:ValueError: bad\n"
        "[default] Rendezvous complete for workers. Result:\n"
        "  local_ranks=[0, 1]\n"
        "  global_ranks=[6, 7]\n"
        "  group_world_size=4\n"
    )
    assert _one(log).rank == 7


def test_on_one_node_local_rank_is_rank_and_on_several_unknown():
    assert _one("[default3]:ValueError: Loss is nan at step 3101, stopping").rank == 3
    several = "  group_world_size=2\n[default3]:ValueError: Loss is nan at step 3101, stopping\n"
    assert _one(several).rank is None


def test_a_ray_worker_keeps_the_rank_it_announced():
    log = (
        "(RayTrainWorker pid=5678, ip=10.0.0.3) Setting up process group for: env://10.0.0.2:45011 "
        "[rank=3, world_size=4]\n"
        "(RayTrainWorker pid=5678, ip=10.0.0.3) ZeroDivisionError: float division by zero\n"
    )
    found = _one(log)
    assert (found.rank, found.node) == (3, "10-0-0-3")


def test_a_rank_named_only_in_the_message():
    found = _one("AssertionError: Rank 5: found NaN in local grad norm in backward pass")
    assert found.rank == 5
    both = _one("NCCL WARN Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000")
    assert both.rank is None  # two ranks named: the message is about both


# --- the year and the time zone ------------------------------------------------------------------


def test_no_year_means_no_time_for_yearless_lines():
    undated = SourceContext(origin="x", year=None, tz=UTC)
    assert (
        _one(
            "[E1202 10:20:11.5 1 ProcessGroupNCCL.cpp:1] [Rank 0] Some NCCL operations have failed or timed out",
            undated,
        ).time
        is None
    )
    dated = _one("2026-12-02T10:20:11Z RuntimeError: CUDA error: uncorrectable ECC error encountered", undated)
    assert dated.time == datetime(2026, 12, 2, 10, 20, 11, tzinfo=UTC)


def test_the_time_zone_applies_to_timestamps_without_an_offset():
    plus_two = SourceContext(origin="x", year=2025, tz=timezone(timedelta(hours=2)))
    found = _one(
        "E0101 01:00:00.000000 1 ProcessGroupNCCL.cpp:1] [Rank 0] Some NCCL operations have failed or timed out",
        plus_two,
    )
    assert found.time == datetime(2024, 12, 31, 23, 0, tzinfo=UTC)


def test_clock_of_reads_the_logs_own_year_and_offset_else_the_fallback():
    mtime = datetime(2031, 1, 2, tzinfo=UTC)
    assert clock_of("E1202 10:00:00.0 1 a.cpp:1] x\n2024-12-02T10:00:01+05:30 y\n", fallback=mtime) == (
        2024,
        timezone(timedelta(hours=5, minutes=30)),
    )
    assert clock_of("E1202 10:00:00.0 1 a.cpp:1] x\n", fallback=mtime) == (2031, UTC)
    assert clock_of("[Wed Dec  3 20:01:00 2025] NVRM: x", fallback=mtime)[0] == 2025


# --- the election on these families --------------------------------------------------------------


def _parsed(files: dict[tuple[str, int | None], str]) -> tuple[list[Evidence], World]:
    found: list[Evidence] = []
    for (node, rank), text in files.items():
        found += parse_text(text, SourceContext(origin=f"{node}/{rank}", node=node, rank=rank, year=2026, tz=UTC))
    ranks = {rank: node for node, rank in files if rank is not None}
    return found, World(ranks=ranks, nodes=frozenset(node for node, _ in files))


def test_nan_before_a_later_exit_code_is_the_algorithm_not_the_host():
    log = (
        "RuntimeError: Function 'MulBackward0' returned nan values in its 0th output.\n"
        "E1117 14:05:41.020000 88120 api.py:869] failed (exitcode: 1) local_rank: 2 (pid: 88133) of binary: python\n"
    )
    finding = elect_first_error(parse_text(log, CONTEXT))
    assert finding.first_error is not None
    assert (finding.first_error.lane, finding.first_error.rank) == (Lane.ALGORITHM, 2)


def test_the_side_that_could_not_connect_first_is_elected_not_the_peer_it_names():
    evidence, world = _parsed(
        {
            ("node-2", 3): "[rank3]:[I1203 08:00:00.000000 1 a.py:1] x\nnode-2:3:3 [3] NCCL WARN socketStartConnect: "
            "Connect to 10.0.0.5<43211> failed : Software caused connection abort\n",
            ("node-4", 6): "[rank6]:[I1203 08:00:05.000000 1 a.py:1] x\nnode-4:6:6 [2] NCCL WARN socketProgress: "
            "Connection closed by remote peer node-2<43990>\n",
        }
    )
    first = elect_first_error(evidence, world=world).first_error
    assert first is not None
    assert (first.lane, first.rank, first.category) == (Lane.NETWORK, 3, "connect_failed")


def test_peer_closed_points_at_the_peer_only_when_nothing_on_its_side_came_first():
    closed = (
        "[rank0]:[I1203 04:00:00.000000 1 a.py:1] x\n"
        "node-1:1:1 [0] NCCL WARN socketProgress: Connection closed by remote peer node-2<50184>\n"
    )
    silent, world = _parsed({("node-1", 0): closed})  # nothing at all from node-2's side
    lost = elect_first_error(silent, world=world)
    assert lost.first_error is not None
    assert (lost.first_error.category, lost.first_error.lane, lost.first_error.node) == (
        "peer_lost",
        Lane.HOST,
        "node-2",
    )
    waiting = (
        "[rank1]:[E1203 03:59:58.000000 2 ProcessGroupNCCL.cpp:1834] [PG ID 0 PG GUID 0(default_pg) Rank 1] Timeout at "
        "NCCL work: 11, last enqueued NCCL work: 11, last completed NCCL work: 10.\n"
    )
    alive, world = _parsed({("node-1", 0): closed, ("node-2", 1): waiting})
    link = elect_first_error(alive, world=world)
    assert link.first_error is not None
    assert (link.first_error.category, link.first_error.lane) == ("peer_link_lost", Lane.NETWORK)
    assert link.confidence < 0.5  # the log cannot say more: low confidence, and what is missing is named
    assert any(m.lane is Lane.NETWORK for m in link.missing_evidence)


def test_a_timeless_hardware_listing_competes_with_the_first_timed_cause():
    evidence, world = _parsed(
        {
            ("node-4", None): "86:00.0 3D controller: NVIDIA Corporation GA100 [A100 SXM4 80GB] (rev ff)\n",
            ("node-4", 2): "[rank2]:[E1203 09:09:09.000000 202 CUDAException.cpp:40] CUDA error: unknown error\n",
        }
    )
    first = elect_first_error(evidence, world=world).first_error
    assert first is not None
    assert (first.lane, first.category, first.rank) == (Lane.HOST, "gpu_xid", 2)
