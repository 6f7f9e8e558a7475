"""Evidence with a time bound, and no blame on a guess: the election's pure core.

A cause is read only within the cause window before the attempt's first exit; an exit status nothing
explains is `unexplained_exit` (platform lane, the missing evidence named), never its node's fault; and
a hang read while several nodes are still silent names none of them.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from lanes_contract.events import EvidenceCategory as C
from lanes_contract.events import EvidenceData, Lane
from lanes_evidence.evidence import Evidence
from lanes_evidence.parsers import SourceContext, parse_text
from lanes_telemetry.domain.election import (
    DEFAULT_CAUSE_WINDOW,
    UNEXPLAINED_EXIT,
    World,
    elect_first_error,
)
from lanes_telemetry.domain.settlement import AttemptStory, RankExit, settled_finding

T0 = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)
REPLICA = World(ranks={0: "gpu-a"})
SERVER_LOG = """\
INFO:     127.0.0.1:51234 - "POST /v1/completions HTTP/1.1" 200 OK
ERROR:    Exception in ASGI application
Traceback (most recent call last):
  File "/usr/lib/python3.11/site-packages/uvicorn/protocols/http/h11_impl.py", line 408, in run_asgi
    result = await app(  # type: ignore[func-returns-value]
  File "/usr/lib/python3.11/site-packages/starlette/responses.py", line 264, in __call__
    await wrap(partial(self.stream_response, send))
ConnectionResetError: [Errno 104] Connection reset by peer
"""


def _server_exception(at: datetime) -> Evidence:
    """The replica server's traceback when the router went away, as the agent stamps it when read."""
    found = parse_text(SERVER_LOG, SourceContext(origin="rank0.log", node="gpu-a", rank=0, year=2026, tz=UTC))
    (exception,) = [e for e in found if e.category is C.PYTHON_EXCEPTION]
    return replace(exception, time=at)


def _agent_fault(at: datetime) -> Evidence:
    """What a restarted agent says about the rank it lost (launcher: `rank ... was lost by its agent`)."""
    said = "rank 0 was lost by its agent: the agent restarted while this rank (pid 4242) ran; nothing read its output"
    data = EvidenceData(category=C.AGENT_FAULT, summary=said, origin="agent", pid=4242)
    return Evidence(data=data, time=at, node="gpu-a", rank=0)


def _lost_exit(at: datetime) -> RankExit:
    return RankExit(rank=0, node="gpu-a", exit_code=None, signal=None, time=at, evidence=2, id="exit-0")


def test_an_exception_sixteen_minutes_before_the_exit_loses_to_the_agents_fault():
    ended = T0 + timedelta(minutes=16)
    story = AttemptStory(
        world=REPLICA,
        evidence=[_server_exception(T0), _agent_fault(ended)],
        exits={0: _lost_exit(ended)},
        heard={0: 2},
    )
    first = settled_finding(story).first_error
    assert first is not None
    assert (first.category, first.lane, first.node) == ("agent_fault", Lane.PLATFORM, "gpu-a")
    # Without the exit, nothing bounds the past (an offline analysis): the earlier exception is first.
    offline = elect_first_error([_server_exception(T0), _agent_fault(ended)], world=REPLICA).first_error
    assert offline is not None
    assert offline.category == "python_exception"


def test_within_the_window_the_agents_fault_and_an_exception_compete_on_equal_terms():
    ended = T0 + timedelta(minutes=16)
    recent = ended - DEFAULT_CAUSE_WINDOW + timedelta(seconds=1)
    story = AttemptStory(
        world=REPLICA,
        evidence=[_server_exception(recent), _agent_fault(ended)],
        exits={0: _lost_exit(ended)},
        heard={0: 2},
    )
    first = settled_finding(story).first_error
    assert first is not None
    assert first.category == "python_exception"  # the earlier of two causes, whatever their lanes
    # The window is a setting: shorter, and the same exception is too old.
    first = settled_finding(replace(story, cause_window=timedelta(seconds=60))).first_error
    assert first is not None
    assert first.category == "agent_fault"


def _timeout_line(rank: int, at: datetime) -> str:
    return (
        f"[rank{rank}]:[E{at:%m%d %H:%M:%S}.392121 2211 ProcessGroupNCCL.cpp:616] [Rank {rank}] Watchdog caught "
        "collective operation timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
        "Timeout(ms)=1800000) ran for 1800047 milliseconds before timing out.\n"
    )


def test_a_collective_timeout_stretches_the_window_back_to_what_its_ranks_waited_for():
    # A 30-minute collective timeout: the Xid that stopped rank 1 is 29 minutes older than the first exit.
    world = World(ranks={0: "node-1", 1: "node-2"})
    ended = T0 + timedelta(minutes=30)
    xid = parse_text(
        f"Dec  2 {T0:%H:%M:%S} node-2 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, GPU has fallen off the bus.\n",
        SourceContext(origin="node-2/kern.log", node="node-2", year=2026, tz=UTC),
    )
    assert [e.category for e in xid] == [C.GPU_XID]
    timeout = parse_text(
        _timeout_line(0, ended - timedelta(seconds=1)),
        SourceContext(origin="rank0.log", node="node-1", rank=0, year=2026, tz=UTC),
    )
    exits = {0: RankExit(0, "node-1", 1, None, ended, evidence=len(timeout), id="x0")}
    first = settled_finding(AttemptStory(world=world, evidence=[*xid, *timeout], exits=exits, heard={0: 1})).first_error
    assert first is not None
    assert (first.category, first.node) == ("gpu_xid", "node-2")


@given(
    age_s=st.floats(min_value=DEFAULT_CAUSE_WINDOW.total_seconds() + 1, max_value=30 * 86_400),
    category=st.sampled_from([C.PYTHON_EXCEPTION, C.GPU_XID, C.ECC_ERROR, C.OOM_KILL, C.LINK_DOWN, C.CUDA_ERROR]),
    node=st.sampled_from(["gpu-a", "gpu-b"]),
)
def test_no_cause_older_than_the_window_ever_changes_the_finding(age_s: float, category: C, node: str):
    ended = T0 + timedelta(days=31)
    story = AttemptStory(
        world=World(ranks={0: "gpu-a"}, nodes=frozenset({"gpu-a", "gpu-b"})),
        evidence=[_agent_fault(ended)],
        exits={0: _lost_exit(ended)},
        heard={0: 1},
    )
    stale = Evidence(EvidenceData(category=category, summary="old"), ended - timedelta(seconds=age_s), node, None)
    with_stale = settled_finding(replace(story, evidence=[stale, *story.evidence]))
    without = settled_finding(story)
    assert with_stale.first_error == without.first_error
    assert with_stale.missing_evidence == without.missing_evidence


def test_an_exit_status_nothing_explains_is_unexplained_and_names_the_missing_evidence():
    world = World(ranks={0: "node-1", 1: "node-2"})
    exits = {
        0: RankExit(0, "node-1", 3, None, T0, evidence=0, id="x0"),
        1: RankExit(1, "node-2", None, 15, T0 + timedelta(seconds=1), evidence=0, id="x1"),
    }
    finding = settled_finding(AttemptStory(world=world, evidence=[], exits=exits))
    first = finding.first_error
    assert first is not None
    assert (first.category, first.lane, first.node, first.rank) == (UNEXPLAINED_EXIT, Lane.PLATFORM, "node-1", 0)
    assert "exited with status 3 and no evidence explains it" in first.summary
    assert finding.settled
    pending = [(m.lane, m.rank, m.what) for m in finding.missing_evidence]
    assert (Lane.ALGORITHM, 0, "an error line in rank 0's own output saying why it exited (none was read)") in pending
    assert not [m for m in finding.missing_evidence if m.lane is Lane.HOST]


def test_an_exit_status_with_its_traceback_is_the_traceback():
    world = World(ranks={0: "node-1"})
    traceback = replace(_server_exception(T0), node="node-1")
    exits = {0: RankExit(0, "node-1", 1, None, T0 + timedelta(milliseconds=200), evidence=1, id="x0")}
    first = settled_finding(AttemptStory(world=world, evidence=[traceback], exits=exits, heard={0: 1})).first_error
    assert first is not None
    assert (first.category, first.lane) == ("python_exception", Lane.ALGORITHM)


def test_a_hang_read_while_several_nodes_are_silent_names_none_of_them():
    world = World(ranks={0: "node-1", 1: "node-2", 2: "node-3"})
    timeout = parse_text(
        _timeout_line(0, T0), SourceContext(origin="rank0.log", node="node-1", rank=0, year=2026, tz=UTC)
    )
    first = elect_first_error(timeout, world=world).first_error
    assert first is not None
    assert (first.category, first.lane, first.node, first.rank) == ("silent_node", Lane.HOST, None, None)
    assert "node-2, node-3" in first.summary
    # Once only one node is silent, the evidence points at it.
    both = timeout + parse_text(
        _timeout_line(1, T0), SourceContext(origin="rank1.log", node="node-2", rank=1, year=2026, tz=UTC)
    )
    first = elect_first_error(both, world=world).first_error
    assert first is not None
    assert (first.category, first.node) == ("silent_node", "node-3")


def _oom_scenario() -> tuple[World, list[Evidence], dict[int, RankExit]]:
    """The settled-recovery scenario before its kernel line: rank 2 (node-3) SIGKILLed, ranks 0 and 1 time out
    and exit 1, each exit counting the one timeout line its rank printed."""
    world = World(ranks={0: "node-1", 1: "node-2", 2: "node-3"})
    killed = T0 + timedelta(seconds=3)
    timeouts = [
        e
        for rank in (0, 1)
        for e in parse_text(
            _timeout_line(rank, killed + timedelta(seconds=1)),
            SourceContext(origin=f"rank{rank}.log", node=f"node-{rank + 1}", rank=rank, year=2026, tz=UTC),
        )
    ]
    exits = {
        2: RankExit(2, "node-3", None, 9, killed, evidence=0, id="x2"),
        0: RankExit(0, "node-1", 1, None, killed + timedelta(seconds=2), evidence=1, id="x0"),
        1: RankExit(1, "node-2", 1, None, killed + timedelta(seconds=2), evidence=1, id="x1"),
    }
    return world, timeouts, exits


@given(arrived=st.sets(st.sampled_from(["timeout-0", "timeout-1", "exit-0", "exit-1", "exit-2"])))
def test_before_the_kernel_line_no_finding_blames_a_node_that_merely_waited(arrived: set[str]) -> None:
    # Whatever part of the story has reached telemetry (a survivor's exit before its own timeout line, one
    # timeout while two nodes are still silent), a finding may say where an exit happened, but only the killed
    # rank's node is ever blamed in the host or network lane.
    world, timeouts, exits = _oom_scenario()
    evidence = [e for e in timeouts if f"timeout-{e.rank}" in arrived]
    known = {rank: ex for rank, ex in exits.items() if f"exit-{rank}" in arrived}
    heard = {e.rank: 1 for e in evidence if e.rank is not None}
    first = settled_finding(AttemptStory(world=world, evidence=evidence, exits=known, heard=heard)).first_error
    if first is not None and first.lane in {Lane.HOST, Lane.NETWORK}:
        assert first.node in {None, "node-3"}, first
