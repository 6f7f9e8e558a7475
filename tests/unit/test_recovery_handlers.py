"""Recovery's handlers on an in-memory store (the port): settled findings, grace, supersession, escalation."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from support.recovery_events import (
    CONFIG,
    DATA,
    MODEL,
    POLICY,
    SPEC,
    T0,
    at,
    changed,
    finding,
    placed,
    released,
    submitted,
)
from support.recovery_fakes import FakeDigests, InMemoryRecoveryStore

from lanes_contract.events import (
    CheckpointSaved,
    CheckpointSavedData,
    Event,
    Lane,
    NodeStateChanged,
    RecoveryAction,
    RecoveryDecided,
    RecoveryEscalated,
    RecoverySuperseded,
    ReplicaStateChanged,
    RetryRequested,
)
from lanes_contract.jobs import JobSpec, JobState, ProtectionMode, ServingSpec, WorkloadClass
from lanes_contract.topology import NodeState
from lanes_recovery.service_layer.handlers import Recovery
from lanes_runtime.consumer import HandlerContext


class Harness:
    """Recovery on a fake store and a clock the test moves."""

    def __init__(self) -> None:
        self.store = InMemoryRecoveryStore()
        self.now = T0
        self.recovery = Recovery(lambda: POLICY, digests=FakeDigests(), clock=lambda: self.now, store=self.store)
        self.published: list[Event] = []

    async def feed(self, *events: Event) -> list[Event]:
        out: list[Event] = []
        for event in events:
            self.now = max(self.now, event.time)
            ctx = HandlerContext(conn=None, stream_seq=len(self.published) + 1, deliveries=1)  # type: ignore[arg-type]
            out.extend(await self.recovery.handle_job_event(event, ctx))
        self.published.extend(out)
        return out

    async def tick(self, at: datetime) -> list[Event]:
        self.now = at
        out = list(await self.recovery.on_timer(None, "job-1", at))  # type: ignore[arg-type]
        self.published.extend(out)
        return out


def _of(events: Sequence[Event], kind: type[Any]) -> list[Any]:
    return [e for e in events if isinstance(e, kind)]


START = (submitted(), placed(nodes=("node-1", "node-2", "node-3")), changed(JobState.FAILED), released())


async def test_an_unsettled_finding_is_not_acted_on_and_a_settled_one_is_with_its_version():
    h = Harness()
    await h.feed(*START)
    assert not _of(await h.feed(finding(Lane.HOST, "silent_node", node="node-1", settled=False)), RecoveryDecided)
    out = await h.feed(finding(Lane.HOST, "oom_kill", node="node-3", version=2, rank=2))
    (decision,) = _of(out, RecoveryDecided)
    assert decision.data.cordon == ("node-3",)
    assert (decision.data.finding_version, decision.data.settled) == (2, True)
    assert "without a settled finding" not in decision.data.reason


async def test_when_the_grace_runs_out_the_decision_says_it_had_no_settled_finding():
    h = Harness()
    await h.feed(*START, finding(Lane.HOST, "process_exited", node="node-3", settled=False))
    out = await h.tick(at(30 + 61))
    (decision,) = _of(out, RecoveryDecided)
    assert decision.data.settled is False
    assert decision.data.finding_version == 1
    assert decision.data.reason.startswith("decided without a settled finding (the grace ran out at finding v1)")


async def test_a_later_settled_finding_before_the_next_placement_supersedes_and_replans():
    h = Harness()
    await h.feed(submitted(), placed(nodes=("node-1", "node-2", "node-3")), changed(JobState.FAILED))
    first = await h.feed(finding(Lane.HOST, "silent_node", node="node-1"))
    assert _of(first, RecoveryDecided)[0].data.cordon == ("node-1",)
    out = await h.feed(finding(Lane.HOST, "oom_kill", node="node-3", version=3, rank=2))
    (notice,) = _of(out, RecoverySuperseded)
    assert notice.data.replanned
    assert notice.data.uncordon == ("node-1",)
    assert notice.data.reason.startswith("decided on host/silent_node on node-1 at v1; the settled finding v3 names")
    states = {(e.node, e.data.state) for e in _of(out, NodeStateChanged)}
    assert states == {("node-1", NodeState.READY), ("node-3", NodeState.CORDONED)}
    (decision,) = _of(out, RecoveryDecided)
    assert (decision.data.finding_version, decision.data.cordon) == (3, ("node-3",))
    retry = _of(await h.feed(released()), RetryRequested)
    assert not retry  # backoff: the retry waits for its timer
    (retry_event,) = _of(await h.tick(at(60)), RetryRequested)
    assert retry_event.data.avoid_nodes == ("node-3",)
    assert h.store.superseded_by  # the first decision stays on record, marked


async def test_a_later_settled_finding_after_the_next_placement_is_escalated_to_the_lane_owner():
    h = Harness()
    await h.feed(submitted(), placed(nodes=("node-1", "node-2", "node-3")), changed(JobState.FAILED))
    await h.feed(finding(Lane.HOST, "silent_node", node="node-1"), released())
    await h.tick(at(60))
    await h.feed(changed(JobState.RETRYING, seconds=61), placed(attempt=2, nodes=("node-2", "node-3"), seconds=62))
    out = await h.feed(finding(Lane.HOST, "oom_kill", node="node-3", version=3, rank=2))
    (escalated,) = _of(out, RecoveryEscalated)
    assert escalated.data.owner == "hal"  # the spec's host owner
    assert "attempt 2 was already requested or placed" in escalated.data.reason
    (notice,) = _of(out, RecoverySuperseded)
    assert not notice.data.replanned
    assert not _of(out, RecoveryDecided)


async def test_a_later_finding_naming_the_same_culprit_changes_nothing():
    h = Harness()
    await h.feed(*START, finding(Lane.HOST, "gpu_xid", node="node-3", rank=2))
    assert not await h.feed(finding(Lane.HOST, "ecc_error", node="node-3", version=2, rank=2))


async def test_the_kernel_line_after_a_decision_on_a_bare_sigkill_cordons_the_node_it_could_not_before():
    h = Harness()
    first = await h.feed(*START, finding(Lane.HOST, "process_exited", node="node-3", rank=2))
    assert _of(first, RecoveryDecided)[0].data.cordon == ()  # a signal alone is no evidence about node-3
    out = await h.feed(finding(Lane.HOST, "oom_kill", node="node-3", version=2, rank=2))
    (notice,) = _of(out, RecoverySuperseded)
    assert notice.data.replanned
    assert notice.data.uncordon == ()
    (decision,) = _of(out, RecoveryDecided)
    assert decision.data.cordon == ("node-3",)
    assert [(e.node, e.data.state) for e in _of(out, NodeStateChanged)] == [("node-3", NodeState.CORDONED)]


async def test_an_inference_replica_is_replaced_on_the_right_node():
    serving = ServingSpec(model="tiny-chat", version="v3", protection=ProtectionMode.QUEUE)
    spec = JobSpec(name="serve", workload_class=WorkloadClass.INFERENCE, workers=1, serving=serving, owners=SPEC.owners)
    h = Harness()
    await h.feed(submitted(spec), placed(nodes=("node-1",)), changed(JobState.FAILED))
    first = await h.feed(finding(Lane.HOST, "silent_node", node="node-1"))
    assert _of(first, ReplicaStateChanged)
    out = await h.feed(finding(Lane.HOST, "gpu_xid", node="node-2", version=2))
    assert _of(out, RecoverySuperseded)[0].data.replanned
    (decision,) = _of(out, RecoveryDecided)
    assert decision.data.cordon == ("node-2",)
    assert _of(out, ReplicaStateChanged)[0].data.reason.startswith("recovery: host/gpu_xid on node-2")


# --- checkpoint digests: bounded, and off the critical path ----------------------------------------


def _zero_checkpoint(job: str) -> CheckpointSaved:
    versions = {"model_version": MODEL, "data_version": DATA, "config_version": CONFIG, "image": SPEC.image}
    data = CheckpointSavedData(step=100, path="/dev/zero", digest="sha256:" + "ab" * 32, **versions)
    return CheckpointSaved(data=data, source="tests", jobid=job, attempt=1, rank=0, node="node-1", time=at(5))


def _job(job: str, *events: Event) -> list[Event]:
    return [e.model_copy(update={"jobid": job}) for e in events]


async def test_a_dev_zero_checkpoint_never_delays_a_canary_jobs_decision_and_its_own_says_unverified():
    h = Harness()
    h.recovery = Recovery(lambda: POLICY, clock=lambda: h.now, store=h.store)  # real background digests
    canary_spec = SPEC.model_copy(update={"workload_class": WorkloadClass.EVALUATION})
    zero = _job("job-zero", submitted(), placed(), _zero_checkpoint("job-zero"), changed(JobState.FAILED))
    canary = _job("job-canary", submitted(canary_spec), placed(), changed(JobState.FAILED))
    settled_oom = finding(Lane.HOST, "oom_kill", node="node-2")
    assert not _of(await h.feed(*zero, settled_oom.model_copy(update={"jobid": "job-zero"})), RecoveryDecided)
    (canary_decision,) = _of(
        await h.feed(*canary, settled_oom.model_copy(update={"jobid": "job-canary"})), RecoveryDecided
    )
    assert canary_decision.job_key == "job-canary"  # decided while job-zero's digest is still pending
    assert h.store.due["job-zero"] is not None  # job-zero's decision comes from its timer
    for _ in range(200):
        await asyncio.sleep(0.01)
        out = list(await h.recovery.on_timer(None, "job-zero", at(60)))  # type: ignore[arg-type]
        if out:
            break
    (decision,) = _of(out, RecoveryDecided)
    assert decision.data.action is RecoveryAction.MANUAL
    assert "unverified: /dev/zero is not a regular file" in decision.data.reason
    assert decision.data.refused[0].found == "unverified: /dev/zero is not a regular file"
