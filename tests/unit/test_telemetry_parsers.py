"""The telemetry parsers on realistic samples of every format, and on arbitrary input (never raise)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lanes_contract.events import EvidenceCategory as C
from lanes_evidence.evidence import Evidence
from lanes_evidence.parsers import (
    LINE_PARSERS,
    MAX_LINE,
    LogParser,
    SourceContext,
    clock_of,
    parse_bytes,
    parse_text,
    parse_time,
    split_prefixes,
)

CONTEXT = SourceContext(origin="sample", year=2026, tz=UTC)
FORMATS = Path(__file__).resolve().parent.parent / "data" / "logs" / "formats"


def _parse(name: str, **context: object) -> list[Evidence]:
    return parse_text((FORMATS / name).read_text(), SourceContext(origin=name, year=2026, tz=UTC, **context))  # type: ignore[arg-type]


def _of(found: list[Evidence], category: C) -> list[Evidence]:
    return [e for e in found if e.category is category]


def test_new_watchdog_format_gives_op_seq_timeout_and_last_enqueued_completed():
    found = _parse("nccl_watchdog_new.log")
    timeouts = _of(found, C.COLLECTIVE_TIMEOUT)
    assert [e.rank for e in timeouts] == [1, 1, 1]
    first = timeouts[0].data
    assert (first.op_type, first.seq_num, first.timeout_ms) == ("ALLREDUCE", 1580, 600000)
    assert first.summary == "ALLREDUCE SeqNum=1580 timed out after 600 s"
    work = timeouts[2].data
    assert (work.seq_num, work.last_enqueued, work.last_completed) == (1580, 1580, 1579)
    assert timeouts[0].time == datetime(2026, 12, 2, 10, 30, 5, 392121, tzinfo=UTC)
    assert _of(found, C.COMM_ERROR)  # "Some NCCL operations have failed or timed out"
    assert found[-1].category is C.RAW  # "To avoid data inconsistency..." is kept, unparsed
    assert all(e.data.lines and e.data.origin == "nccl_watchdog_new.log" for e in found)


def test_old_watchdog_format_without_timestamps():
    found = _parse("nccl_watchdog_old.log", rank=5, node="node-3")
    timeouts = _of(found, C.COLLECTIVE_TIMEOUT)
    assert len(timeouts) == 2  # the watchdog line and the `what():` of the uncaught exception
    assert {(e.data.op_type, e.data.seq_num, e.data.timeout_ms) for e in timeouts} == {("BROADCAST", 212, 1800000)}
    assert all(e.time is None and e.rank == 5 and e.node == "node-3" for e in found)


def test_gloo_errors_name_the_peer_or_the_timeout():
    found = _parse("gloo.log")
    assert [e.category for e in found] == [C.PEER_CLOSED, C.COLLECTIVE_TIMEOUT, C.PEER_CLOSED, C.COMM_INIT_FAILURE]
    assert found[0].rank == 2
    assert (found[0].data.peer, found[2].data.peer) == ("10.0.1.12", "10.0.1.13")
    assert found[1].data.timeout_ms == 1800000


def test_torchelastic_summary_root_cause_and_other_failures():
    found = _parse("torchelastic_summary.log")
    exits = _of(found, C.PROCESS_EXITED)
    by_rank = {e.rank: e for e in exits}
    root = by_rank[3]
    assert root.data.signal == 9
    assert root.data.exit_code is None
    assert root.data.pid == 41235
    assert root.node == "node-2"  # host name node-2.cluster.local, first label
    assert root.time == datetime(2026, 12, 2, 10, 20, 4, tzinfo=UTC)
    assert "root cause (first observed failure)" in root.data.summary
    assert by_rank[2].data.signal == 15
    assert "first observed" not in by_rank[2].data.summary
    # torchrun's own one-line report of the same death names local_rank 1: the summary maps it to rank 3
    one_line = [e for e in exits if "local_rank 1" in e.data.summary]
    assert [(e.data.signal, e.data.pid, e.rank) for e in one_line] == [(9, 41235, 3)]
    # The ChildFailedError traceback itself is not a Python exception of the job
    assert not _of(found, C.PYTHON_EXCEPTION)


def test_nccl_debug_lines():
    found = _parse("nccl_debug.log")
    assert [e.category for e in found] == [
        C.RAW,
        C.RETRY_EXCEEDED,
        C.RAW,
        C.PEER_CLOSED,
        C.CUDA_OOM,
        C.CONFIG_MISMATCH,  # "no socket interface found": NCCL_SOCKET_IFNAME names no interface of the host
        C.COMM_ERROR,
    ]
    assert [e.node for e in found] == ["node-1", "node-1", "node-1", "node-3", "node-4", "node-2", "node-1"]
    assert found[1].data.peer == "10.0.1.12"
    assert found[1].data.pid == 2201
    assert found[3].data.peer == "node-2"


def test_rank_prefixed_tracebacks_become_one_evidence_each():
    found = _parse("traceback_rank.log")
    assert [(e.rank, e.category) for e in found] == [(3, C.PYTHON_EXCEPTION), (5, C.COMM_ERROR)]
    exc = found[0].data
    assert exc.error_type == "RuntimeError"
    assert exc.summary.startswith("RuntimeError: shape '[-1, 32000]' is invalid")
    assert exc.lines[0] == "[rank3]: Traceback (most recent call last):"
    assert exc.lines[-1].endswith("is invalid for input of size 4198400")
    assert sum("File " in line for line in exc.lines) == 3  # the last frames only


def test_cuda_errors():
    found = _parse("cuda_errors.log")
    assert [e.category for e in found] == [C.CUDA_OOM, C.CUDA_ERROR, C.RAW]
    assert found[0].rank == 6
    assert found[0].data.error_type == "torch.OutOfMemoryError"
    assert "illegal memory access" in found[1].data.summary


def test_kernel_lines():
    found = _parse("kernel.log", node="node-9")
    categories = [e.category for e in found]
    assert categories == [
        C.RAW,
        C.OOM_KILL,
        C.OOM_KILL,
        C.GPU_XID,
        C.GPU_XID,  # "GPU has fallen off the bus" without an Xid number
        C.ECC_ERROR,
        C.LINK_DOWN,
        C.LINK_UP,
        C.LINK_DOWN,
        C.DISK_FULL,
    ]
    assert {e.data.pid for e in _of(found, C.OOM_KILL)} == {41235}
    xid = _of(found, C.GPU_XID)[0]
    assert (xid.data.xid, xid.data.gpu, xid.node) == (79, "0000:3b:00", "node-9")  # dmesg -T names no host
    assert xid.time == datetime(2026, 12, 2, 10, 21, 13, tzinfo=UTC)
    assert _of(found, C.ECC_ERROR)[0].data.xid == 48
    assert [e.data.interface for e in _of(found, C.LINK_DOWN)] == ["ibp94s0", "ens1f0"]
    assert found[1].node == "node-2"  # the syslog host wins over the file's node


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("2026-12-02T10:20:11.123456+02:00 x", datetime(2026, 12, 2, 8, 20, 11, 123456, tzinfo=UTC)),
        ("2026-12-02 10:20:11,250 INFO x", datetime(2026, 12, 2, 10, 20, 11, 250000, tzinfo=UTC)),
        ("[E1202 10:20:11.5 1 f.cpp:1] x", datetime(2026, 12, 2, 10, 20, 11, 500000, tzinfo=UTC)),
        ("Dec  2 10:20:11 node-1 kernel: x", datetime(2026, 12, 2, 10, 20, 11, tzinfo=UTC)),
        ("no time here", None),
    ],
)
def test_timestamps(line, expected):
    assert parse_time(line, 2026, UTC) == expected


def test_a_line_without_time_inherits_the_last_time_seen():
    found = parse_text(
        "[rank0]:[I1202 10:00:00.000000 1 a.py:1] step 5\nnode-1:1:1 [0] NCCL WARN Cuda failure 'x'\n", CONTEXT
    )
    assert found[1].time == datetime(2026, 12, 2, 10, 0, tzinfo=UTC)


def test_impossible_dates_and_huge_numbers_degrade_to_raw():
    found = parse_text("2026-02-31T10:00:00Z boom\nWorkNCCL(SeqNum=" + "9" * 5000 + ")\n", CONTEXT)
    assert [e.category for e in found][:1] == [C.RAW]
    assert len(found) == 2


def test_unknown_lines_are_raw_evidence_and_long_lines_are_cut():
    found = parse_text("hello world\n" + "x" * (MAX_LINE * 3), CONTEXT)
    assert [e.category for e in found] == [C.RAW, C.RAW]
    assert len(found[1].data.lines[0]) == MAX_LINE


_SAMPLE_LINES = [
    line
    for path in sorted(FORMATS.parent.rglob("*"))
    if path.is_file() and path.suffix != ".toml"  # every log of every corpus case, and the format samples
    for line in path.read_text().splitlines()
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=4096))
def test_arbitrary_bytes_never_raise(data):
    found = parse_bytes(data, SourceContext(origin="fuzz", year=2026, tz=UTC))
    assert all(isinstance(e, Evidence) for e in found)


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=2000))
def test_arbitrary_text_never_raises_in_any_line_parser(text):
    for parser in LINE_PARSERS:
        parser(text)
    parse_time(text, 2026, UTC)
    parse_time(text, None, UTC)
    parse_text(text, CONTEXT)
    split_prefixes(text)
    clock_of(text, fallback=datetime(2026, 1, 1, tzinfo=UTC))


@settings(max_examples=300, deadline=None)
@given(
    lines=st.lists(
        st.one_of(
            st.sampled_from(_SAMPLE_LINES),
            st.tuples(st.sampled_from(_SAMPLE_LINES), st.integers(0, 300), st.text(max_size=20)).map(
                lambda t: t[0][: t[1]] + t[2] + t[0][t[1] :]
            ),
            st.text(max_size=80),
        ),
        max_size=60,
    )
)
def test_mutated_real_lines_in_any_order_never_raise(lines):
    parser = LogParser(SourceContext(node="node-1", rank=0, year=2026, tz=UTC))
    found = [e for line in lines for e in parser.feed(line)] + parser.finish()
    assert all(e.node is None or "." not in e.node for e in found)


def test_lines_as_launchers_really_write_them():
    # A wrapper's `[pid]` before torchrun's `[rankN]:`, c10's unpadded month (E321 = March 21), nanoseconds.
    line = (
        "[80746] [rank0]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:1664] [PG 1 Rank 0] Exception (either an "
        "error or timeout) detected by watchdog at work: 1580, last enqueued NCCL work: 1582, last completed NCCL "
        "work: 1579."
    )
    (found,) = parse_text(line, CONTEXT)
    assert found.category is C.COLLECTIVE_TIMEOUT
    assert found.rank == 0
    assert found.time == datetime(2026, 3, 21, 2, 7, 8, 408271, tzinfo=UTC)
    assert (found.data.seq_num, found.data.last_enqueued, found.data.last_completed) == (1580, 1582, 1579)
    what = (
        "  what():  [PG 3 Rank 5] Process group watchdog thread terminated with exception: [Rank 5] Watchdog caught "
        "collective operation timeout: WorkNCCL(SeqNum=9141, OpType=_ALLGATHER_BASE, NumelIn=19008, "
        "NumelOut=152064, Timeout(ms)=600000) ran for 600020 milliseconds before timing out."
    )
    (timeout,) = parse_text(what, CONTEXT)
    assert (timeout.rank, timeout.data.op_type, timeout.data.seq_num) == (5, "_ALLGATHER_BASE", 9141)


def test_ib_completion_errors_with_ipv6_peers_and_plugin_prefixes():
    line = (
        "H100-2:19989:20082 [1] transport/net_ib.cc:1295 NCCL WARN NET/IB : Got completion from peer "
        "fe80::966d:ae03:8b:df78%ib0<53249> with error 4, opcode 32564, len 32564, vendor err 81 (Send)"
    )
    (found,) = parse_text(line, CONTEXT)
    assert (found.category, found.node, found.data.peer) == (C.COMM_ERROR, "H100-2", "fe80::966d:ae03:8b:df78%ib0")
    plugin = (
        "kp-ddp-worker-0:3468:3905 [4] ib_plugin.c:1615 NCCL WARN NET/IB : Got completion from peer "
        "10.216.210.236<54862> with status=12 opcode=0 len=0 vendor err 129 (Recv) localGid fd00::ff22"
    )
    (retry,) = parse_text(plugin, CONTEXT)
    assert (retry.category, retry.node, retry.data.peer) == (C.RETRY_EXCEEDED, "kp-ddp-worker-0", "10.216.210.236")
