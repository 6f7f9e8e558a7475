"""Telemetry's handlers on an in-memory store (the port): settlement, pid matching, shared evidence."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from support.recovery_events import at
from support.telemetry_fakes import InMemoryTelemetryStore

from lanes_cli.render import summarize
from lanes_contract.events import (
    CommunicationEvidence,
    Event,
    EvidenceCategory,
    EvidenceData,
    HostEvidence,
    JobEvidence,
    JobEvidenceData,
    JobFinding,
    JobPlaced,
    JobPlacedData,
    JobStateChanged,
    JobStateChangedData,
    ProcessEvidence,
    RankAssignment,
    RankExited,
    RankExitedData,
    RankStarted,
    RankStartedData,
    SettleWindowEnded,
    SettleWindowEndedData,
)
from lanes_contract.jobs import JobState
from lanes_runtime.consumer import HandlerContext, TransactionScope
from lanes_telemetry.service_layer.handlers import CONSEQUENCE_COPIES, CORRELATION_SKEW, Telemetry, _NodeWindow
from lanes_telemetry.service_layer.ports import PlacementSpan, placements_at

C = EvidenceCategory


class Harness:
    def __init__(self) -> None:
        self.store = InMemoryTelemetryStore()
        self.telemetry = Telemetry(store=self.store)
        self.seq = 0

    def _ctx(self) -> HandlerContext:
        self.seq += 1
        return HandlerContext(conn=None, stream_seq=self.seq, deliveries=1)  # type: ignore[arg-type]

    async def facts(self, *events: Event) -> list[Event]:
        return [out for e in events for out in await self.telemetry.handle_job_event(e, self._ctx())]

    async def evidence(self, *events: Event) -> list[Event]:
        return [out for e in events for out in await self.telemetry.handle_evidence(e, self._ctx())]


def _keys(job: str, seconds: float, **more: Any) -> dict[str, Any]:
    return {"source": "tests", "jobid": job, "attempt": 1, "time": at(seconds)} | more


def _placed(job: str, nodes: Sequence[str], seconds: float = 1) -> JobPlaced:
    assignments = tuple(RankAssignment(rank=r, node=n, gpus=(r,)) for r, n in enumerate(nodes))
    return JobPlaced(data=JobPlacedData(assignments=assignments), **_keys(job, seconds))


def _started(job: str, rank: int, node: str, pid: int) -> RankStarted:
    return RankStarted(data=RankStartedData(pid=pid), **_keys(job, 2, rank=rank, node=node))


def _exited(job: str, rank: int, node: str, *, signal: int | None = None, evidence: int = 0) -> RankExited:
    data = RankExitedData(exit_code=None if signal else 1, signal=signal, evidence=evidence)
    return RankExited(data=data, **_keys(job, 10 + rank * 0.1, rank=rank, node=node))


def _timeout(job: str, rank: int, node: str) -> CommunicationEvidence:
    data = EvidenceData(category=C.COLLECTIVE_TIMEOUT, op_type="ALLREDUCE", seq_num=1580, pid=100 + rank)
    return CommunicationEvidence(data=data, **_keys(job, 10.5, rank=rank, node=node))


def _kernel(node: str, pid: int | None, seconds: float = 10) -> HostEvidence:
    data = EvidenceData(category=C.OOM_KILL, summary=f"Out of memory: Killed process {pid}", pid=pid)
    return HostEvidence(source="agent", node=node, time=at(seconds), data=data)


def _findings(events: Sequence[Event]) -> list[JobFinding]:
    return [e for e in events if isinstance(e, JobFinding)]


async def test_a_finding_waits_for_every_ranks_story_and_the_kernel_line_then_settles_on_the_killed_rank():
    h = Harness()
    nodes = ("node-1", "node-2", "node-3")
    await h.facts(_placed("j", nodes), *(_started("j", r, n, 100 + r) for r, n in enumerate(nodes)))
    (first,) = _findings(await h.evidence(_timeout("j", 0, "node-1")))
    assert not first.data.settled  # one timeout: a guess, and it says what it waits for
    (killed,) = _findings(await h.facts(_exited("j", 2, "node-3", signal=9)))
    cause = killed.data.first_error
    assert cause is not None
    assert (cause.category, cause.lane.value, cause.node, cause.rank) == ("process_exited", "host", "node-3", 2)
    assert "killed by SIGKILL: OOM killer or operator; kernel log pending" in cause.summary
    assert not killed.data.settled
    assert "the kernel log of node-3 (rank 2 was killed by SIGKILL)" in killed.data.waiting_for
    await h.facts(_exited("j", 0, "node-1", evidence=1), _exited("j", 1, "node-2", evidence=1))
    (oom,) = _findings(await h.evidence(_kernel("node-3", 102)))  # no job, no rank: matched by its pid
    assert oom.data.first_error is not None
    assert (oom.data.first_error.category, oom.data.first_error.rank) == ("oom_kill", 2)
    assert oom.data.waiting_for == ("1 evidence item rank 1 reported before its exit",)
    (settled,) = _findings(await h.evidence(_timeout("j", 1, "node-2")))
    assert settled.data.settled
    assert settled.data.settle_reason == "every rank and node of the attempt is accounted for"
    assert settled.data.first_error == oom.data.first_error


async def test_a_rank_killed_by_sigbus_waits_for_its_nodes_kernel_line_read_after_the_exit():
    # The order CI once saw: the lifecycle's exit reached telemetry a moment before the node's Xid line.
    h = Harness()
    await h.facts(_placed("j", ("node-1",)), _started("j", 0, "node-1", 100))
    (bare,) = _findings(await h.facts(_exited("j", 0, "node-1", signal=7)))
    assert not bare.data.settled
    assert bare.data.waiting_for == ("the kernel log of node-1 (rank 0 was killed by SIGBUS)",)
    xid = EvidenceData(category=C.GPU_XID, summary="NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus", xid=79)
    (explained,) = _findings(await h.evidence(HostEvidence(source="agent", node="node-1", time=at(10), data=xid)))
    assert explained.data.settled
    assert explained.data.first_error is not None
    assert (explained.data.first_error.category, explained.data.first_error.node) == ("gpu_xid", "node-1")


async def test_the_settle_window_settles_a_finding_on_what_arrived_and_says_what_never_did():
    h = Harness()
    await h.facts(_placed("j", ("node-1", "node-2")))
    await h.evidence(_timeout("j", 0, "node-1"))
    failed = JobStateChangedData(from_state=JobState.RUNNING, to_state=JobState.FAILED, cause_type="x")
    assert not await h.facts(JobStateChanged(data=failed, **_keys("j", 11)))
    window = SettleWindowEndedData(ended_at=at(11), window_s=5)
    (finding,) = _findings(await h.facts(SettleWindowEnded(data=window, **_keys("j", 16))))
    assert finding.data.settled
    assert finding.data.settle_reason.startswith("the settle window (5 s) ended; never arrived: node-2: silent")


async def test_node_level_evidence_on_a_shared_node_is_shared_unless_its_pid_names_the_job():
    h = Harness()
    await h.facts(_placed("a", ("node-x",)), _placed("b", ("node-x",), seconds=2), _started("b", 0, "node-x", 4242))
    shared = await h.evidence(_kernel("node-x", None))
    assert {(e.jobid, e.data.shared) for e in shared if isinstance(e, JobEvidence)} == {("a", True), ("b", True)}
    assert not _findings(shared)  # shared evidence is nobody's first error on its own
    own = await h.evidence(_kernel("node-x", 4242, seconds=11))
    assert {(e.jobid, e.data.shared) for e in own if isinstance(e, JobEvidence)} == {("b", False)}
    (finding,) = _findings(own)
    assert (finding.jobid, finding.data.first_error and finding.data.first_error.category) == ("b", "oom_kill")


async def test_evidence_from_a_ranks_output_belongs_to_the_job_its_producer_names():
    h = Harness()
    await h.facts(_placed("a", ("node-x",)), _placed("b", ("node-x",), seconds=2))
    data = EvidenceData(category=C.PYTHON_EXCEPTION, summary="ValueError: bad batch", error_type="ValueError")
    out = await h.evidence(ProcessEvidence(data=data, **_keys("a", 5, rank=0, node="node-x")))
    assert {e.jobid for e in out} == {"a"}  # never the job placed on the node most recently


async def test_the_timeline_gets_every_possible_cause_but_only_the_first_consequences_of_a_category():
    # 20 ranks time out in one all-reduce and one rank is OOM-killed: the timeline shows the kill and the first
    # CONSEQUENCE_COPIES timeouts (the last of them says so); the finding counts all 20. One by one, or in
    # batches of any size, the same evidence is copied.
    nodes = tuple(f"node-{r}" for r in range(21))
    facts = [_placed("j", nodes), *(_started("j", r, n, 100 + r) for r, n in enumerate(nodes))]
    timeouts: list[Event] = [_timeout("j", r, f"node-{r}") for r in range(1, 21)]
    storm = [*timeouts[:12], _kernel("node-0", 100), *timeouts[12:]]
    copied: dict[str, list[JobEvidence]] = {}
    for batch in (1, 5, len(storm)):
        h = Harness()
        await h.facts(*facts)
        outputs: list[Event] = []
        for start in range(0, len(storm), batch):
            scope = TransactionScope(deferred=batch > 1)
            for event in storm[start : start + batch]:
                ctx = HandlerContext(conn=None, stream_seq=h.seq, deliveries=1, scope=scope)  # type: ignore[arg-type]
                outputs += await h.telemetry.handle_evidence(event, ctx)
            outputs += [output for _, output in await scope.flush()]
        copied[f"batch of {batch}"] = [e for e in outputs if isinstance(e, JobEvidence)]
        finding = _findings(outputs)[-1].data
        assert [(g.category, g.count) for g in finding.consequences] == [("collective_timeout", 20)]

    for copies in copied.values():
        timeouts = [c for c in copies if c.data.evidence.category is C.COLLECTIVE_TIMEOUT]
        assert [c.rank for c in timeouts] == list(range(1, CONSEQUENCE_COPIES + 1))
        assert [c.data.last_copy_of_category for c in timeouts] == [False] * (CONSEQUENCE_COPIES - 1) + [True]
        assert [c.rank for c in copies if c.data.evidence.category is C.OOM_KILL] == [0]  # a cause, past the cap
    assert len({tuple(c.id for c in copies) for copies in copied.values()}) == 1


async def test_a_batch_stores_its_evidence_before_its_elections_and_elects_what_one_by_one_would():
    # In a batch, evidence is stored in one statement before the commit and each attempt elected once then.
    # The final finding must be the one the events give one at a time.
    storm = [_timeout("j", r, f"node-{r}") for r in range(1, 6)] + [_kernel("node-3", 103)]
    nodes = tuple(f"node-{r}" for r in range(6))
    facts = [_placed("j", nodes), *(_started("j", r, n, 100 + r) for r, n in enumerate(nodes))]

    one_by_one = Harness()
    await one_by_one.facts(*facts)
    alone = _findings(await one_by_one.evidence(*storm))[-1]

    batched = Harness()
    await batched.facts(*facts)
    scope = TransactionScope(deferred=True, keys=frozenset(nodes))
    copies: list[Event] = []
    for seq, event in enumerate(storm, start=1):
        ctx = HandlerContext(conn=None, stream_seq=seq, deliveries=1, scope=scope)  # type: ignore[arg-type]
        copies += await batched.telemetry.handle_evidence(event, ctx)
        assert batched.store.evidence == {}  # nothing stored before the batch commits
    assert copies == []  # the copies, too, wait for the batch's last event
    produced = [output for _, output in await scope.flush()]
    assert set(batched.store.evidence) == {event.id for event in storm}
    assert [c.data.evidence_id for c in produced if isinstance(c, JobEvidence)] == [e.id for e in storm]
    (together,) = _findings(produced)  # one election for the attempt, over everything the batch stored
    assert together.data.first_error == alone.data.first_error
    assert together.data.first_error is not None
    assert (together.data.first_error.category, together.data.first_error.rank) == ("oom_kill", 3)


def test_the_timeline_line_of_the_last_copied_consequence_says_the_rest_are_in_the_finding() -> None:
    data = EvidenceData(category=C.COLLECTIVE_TIMEOUT, lines=("Watchdog caught collective operation timeout",))
    copy = JobEvidence(
        source="lanes/telemetry", jobid="j", attempt=1, data=JobEvidenceData(evidence_id="e", evidence=data)
    )
    assert summarize(copy) == "collective_timeout: Watchdog caught collective operation timeout"
    last = copy.model_copy(update={"data": copy.data.model_copy(update={"last_copy_of_category": True})})
    assert summarize(last).endswith("further ones are counted in the finding, not copied")


_SECONDS = st.integers(min_value=0, max_value=40)


@given(
    spans=st.lists(
        st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 7), _SECONDS, st.none() | _SECONDS), max_size=12
    ),
    times=st.lists(st.integers(min_value=-5, max_value=50), min_size=1, max_size=20),
)
@settings(max_examples=300, deadline=None)
def test_a_node_windows_remembered_answers_are_the_filters_answers(
    spans: list[tuple[str, int, int, int | None]], times: list[int]
) -> None:
    placed = [
        PlacementSpan(job, 1, rank, at(start), None if end is None else at(start + end))
        for job, rank, start, end in spans
    ]
    window = _NodeWindow(at(-100), at(100), placed)
    for second in times:  # in any order, each time asked again or for the first time
        assert window.placements_at(at(second)) == placements_at(placed, at(second), CORRELATION_SKEW)


async def test_a_node_where_other_jobs_exited_unexplained_is_no_repeat_offender_but_one_with_an_oom_is():
    h = Harness()
    for job in ("a", "b"):  # two jobs whose only rank exits 1 without a word on node-1
        await h.facts(_placed(job, ("node-1",)), _started(job, 0, "node-1", 100))
        (silent,) = _findings(await h.facts(_exited(job, 0, "node-1")))
        assert silent.data.first_error is not None
        assert silent.data.first_error.category == "unexplained_exit"
        assert "repeat offender" not in silent.data.first_error.summary
    await h.facts(_placed("c", ("node-1",)), _started("c", 0, "node-1", 300))
    await h.facts(_exited("c", 0, "node-1", signal=9))
    (oom,) = _findings(await h.evidence(_kernel("node-1", 300)))
    assert oom.data.first_error is not None
    assert "repeat offender" not in oom.data.first_error.summary  # the unexplained exits do not count
    await h.facts(_placed("d", ("node-1",)), _started("d", 0, "node-1", 400))
    await h.facts(_exited("d", 0, "node-1", signal=9))
    (again,) = _findings(await h.evidence(_kernel("node-1", 400)))
    assert again.data.first_error is not None
    assert "repeat offender: node-1 was the first error of 1 other job(s)" in again.data.first_error.summary
